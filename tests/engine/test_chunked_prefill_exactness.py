"""Chunked prefill is exact: any chunk size gives the unchunked run's greedy tokens and its logits to
float32 rounding (1e-5 + 2e-6 relative).

Seed 003: the chunk-wise causal mask is the same triangle as one big prefill, only computed in pieces.
Pieces sum in another order, and a CPU's vector width decides XLA's order too: one CI machine put one
logit of 8448 at -9.26020 against -9.26019 (1.05e-5, about 11 float32 ulps at that size), so the bound
is relative as well as absolute.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp import SamplingParams

PROMPT_LEN, NUM_TOKENS = 600, 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def long_prompt(vocab: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(3, min(vocab, 250), PROMPT_LEN)]


def short_prompts() -> list[list[int]]:
    return [[10 + i for i in range(n)] for n in (5, 9)]


@pytest.fixture(scope="module")
def reference(make_llm):
    """Every prompt alone, unchunked, in one forward."""
    llm = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=1024, page_size=16)
    prompts = [long_prompt(llm.engine.sizing.spec.config.vocab_size), *short_prompts()]
    return {tuple(p): llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts}


def assert_same(out, ref):
    assert out.token_ids == ref.token_ids
    got, want = np.stack(out.logits), np.stack(ref.logits)
    assert got.shape == want.shape == (NUM_TOKENS, got.shape[1])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("chunk", [64, 128, 192, 512, "whole"])
def test_chunked_equals_unchunked(reference, make_llm, page_size, chunk):
    if chunk == "whole":
        llm = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=1024, page_size=page_size)
    else:
        llm = make_llm(max_num_batched_tokens=chunk, page_size=page_size)
    long = next(p for p in reference if len(p) == PROMPT_LEN)
    # Short requests go first so they are decoding while the long prompt's chunks go through.
    outs = llm.generate(prompt_token_ids=[*short_prompts(), list(long)], sampling_params=GREEDY)
    for out in outs:
        assert_same(out, reference[tuple(out.prompt_token_ids)])


@pytest.mark.slow
def test_chunked_equals_unchunked_with_pallas_kernel_in_interpret_mode(make_llm):
    """The same exactness through the Pallas kernel (interpret mode on CPU), on a small config."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 150))
    kw = dict(max_model_len=256, attention_backend="pallas", num_pages=40)
    whole = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=256, **kw)
    chunked = make_llm(max_num_batched_tokens=64, **kw)
    want = whole.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    got = chunked.generate(prompt_token_ids=[[5, 6, 7], prompt], sampling_params=params)[1]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-5, rtol=0)
