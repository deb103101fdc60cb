"""Prefix caching is exact: a request served from cached pages gets the greedy tokens of the same
request computed from scratch, and its logits to 1e-5 (float32, the bundled tiny model).

Two engines for the module (one 64-token bucket each, so one compile): caching on and off. Each test
starts from an empty cache and uses its own tokens, so the cases do not feed each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp import SamplingParams

PS = 16
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FLAGS = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=320, page_size=PS)


@pytest.fixture(scope="module")
def engines(make_llm):
    on, off = make_llm(**FLAGS), make_llm(**FLAGS, enable_prefix_caching=False)
    yield on, off
    on.close()
    off.close()


@pytest.fixture
def cached(engines):
    on, off = engines
    on.engine.scheduler.forget_cached_pages()
    return on


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def reference(engines, prompt_list):
    return engines[1].generate(prompt_token_ids=prompt_list, sampling_params=GREEDY)


def assert_same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("prefix_len", "cached_tokens"), [
    (10, 0),     # shorter than a page: nothing is shared
    (32, 32),    # exactly two pages
    (200, 192),  # twelve whole pages and a partial one: the partial one is computed again
])
def test_a_shared_prefix_is_exact(engines, cached, prefix_len, cached_tokens):
    prefix = tokens(prefix_len, prefix_len)
    first, second = prefix + tokens(1, 7), prefix + tokens(2, 9)
    outs = [cached.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in (first, second)]
    assert [o.num_cached_tokens for o in outs] == [0, cached_tokens]
    assert_same(outs, reference(engines, [first, second]))


@pytest.mark.slow
@pytest.mark.parametrize("length", [48, 50])
def test_an_entirely_cached_prompt_is_exact(engines, cached, length):
    p = tokens(length, length)
    outs = [cached.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for _ in range(2)]
    # Its last token is always computed, so the page holding it is not taken from the cache.
    assert outs[1].num_cached_tokens == (length - 1) // PS * PS
    assert_same(outs, reference(engines, [p, p]))


@pytest.mark.slow
def test_two_requests_admitted_together_then_a_third_is_exact(engines, cached):
    prefix = tokens(3, 24)
    together = [prefix + tokens(4, 4), prefix + tokens(5, 5)]   # 57 tokens: one step admits both
    outs = cached.generate(prompt_token_ids=together, sampling_params=GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    third = prefix + tokens(6, 3)
    outs += cached.generate(prompt_token_ids=[third], sampling_params=GREEDY)
    assert outs[-1].num_cached_tokens == 16
    assert_same(outs, reference(engines, [*together, third]))


@pytest.mark.slow
def test_the_pages_of_an_aborted_prefill_are_exact(engines, cached):
    long = tokens(7, 150)
    engine = cached.engine
    engine.add_request("aborted", long, GREEDY)
    engine.step()
    engine.step()  # two 64-token chunks submitted: pages 0-7 written
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        engine.step()
    again = long + tokens(8, 5)
    out = cached.generate(prompt_token_ids=[again], sampling_params=GREEDY)[0]
    assert out.num_cached_tokens == 128
    assert_same([out], reference(engines, [again]))
    assert engine.stats().num_pages_used == 0
