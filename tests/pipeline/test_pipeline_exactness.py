"""Pipeline and tensor parallelism change where the math runs, never its result.

Every (P, T) layout, with chunked prefill (64-token budget) and steps that mix decodes with prompt
chunks, gives the single-device engine's tokens and logits to 1e-5 in float32; the reference runs each
prompt unchunked. Nothing compiles after warm-up. TP reorders float32 sums (the row-parallel
all-reduces), so the match is to 1e-5 rather than bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp import SamplingParams
from jaxcpp.runtime.compile_guard import forbid_compile

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=3, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = (5, 30, 120, 40)  # the short ones decode while the 120-token prompt's chunks pass
    return [[int(t) for t in rng.integers(2, 128, n)] for n in lengths]


SAMPLING = [GREEDY, GREEDY, GREEDY, SEEDED]


def run(llm):
    return llm.generate(prompt_token_ids=prompts(), sampling_params=SAMPLING)


@pytest.fixture(scope="module")
def reference(pp_llm, random_model):
    llm = pp_llm(model=random_model, enable_chunked_prefill=False, max_num_batched_tokens=128)
    return run(llm)


def assert_same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        got, want = np.stack(out.logits), np.stack(ref.logits)
        assert got.shape == want.shape == (MAX_TOKENS, 128)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "tp", "partition"), [
    (1, 1, None),       # the single-device engine, chunked
    (2, 1, None),
    (4, 1, None),       # 6 layers: 1,1,2,2 by default
    (2, 2, None),
    (4, 2, None),
    (3, 1, "1,3,2"),    # an explicit uneven partition
])
def test_layouts_match_single_device(pp_llm, random_model, reference, pp, tp, partition):
    llm = pp_llm(model=random_model, pipeline_parallel_size=pp, tensor_parallel_size=tp, pp_partition=partition)
    assert llm.engine.executor.max_in_flight == pp
    with forbid_compile():
        outs = run(llm)
    assert llm.engine.stats().num_compilations_since_warmup == 0
    assert_same(outs, reference)


@pytest.mark.slow
def test_replicated_kv_heads_and_tied_head(pp_llm, mqa_tied_model):
    """One KV head cannot split over T = 2: pages and K/V projections replicate, queries still split;
    the tied LM head puts the embedding on the last stage too."""
    ref = run(pp_llm(model=mqa_tied_model))
    llm = pp_llm(model=mqa_tied_model, pipeline_parallel_size=2, tensor_parallel_size=2)
    with forbid_compile():
        outs = run(llm)
    assert_same(outs, ref)
