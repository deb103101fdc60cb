"""An fp8 KV cache (and fp8 weights) under pipeline and tensor parallelism, in-process and in stage
processes: every layout gives the single-device fp8 engine's greedy tokens. Each stage quantizes its own
layers' pages with its own scales; TP shards the 8-bit pages on the KV-head axis like any other."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp.runtime.compile_guard import forbid_compile
from tests.pipeline.test_pipeline_exactness import SAMPLING, prompts

pytestmark = pytest.mark.slow

FP8 = dict(kv_cache_dtype="fp8")


def run(llm):
    return llm.generate(prompt_token_ids=prompts(), sampling_params=SAMPLING)


def assert_same_tokens(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        # TP reorders float32 sums; a K/V value that lands on a rounding edge may store one fp8 step apart,
        # which moved a logit by 2.2e-3 (fp8 weights + cache, PP 2 x TP 2): the tokens must not move
        np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=1e-2, rtol=0)


@pytest.fixture(scope="module")
def fp8_reference(pp_llm, random_model):
    return run(pp_llm(model=random_model, **FP8))


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (2, 2), (4, 2)])
def test_fp8_cache_layouts_match_single_device(pp_llm, random_model, fp8_reference, pp, tp):
    llm = pp_llm(model=random_model, pipeline_parallel_size=pp, tensor_parallel_size=tp, **FP8)
    assert llm.engine.model_info().kv_cache_dtype == "float8_e4m3fn"
    with forbid_compile():
        outs = run(llm)
    assert_same_tokens(outs, fp8_reference)


def test_fp8_weights_and_cache_layouts_match_single_device(pp_llm, random_model):
    both = dict(quantization="fp8", **FP8)
    ref = run(pp_llm(model=random_model, **both))
    assert_same_tokens(run(pp_llm(model=random_model, pipeline_parallel_size=2, tensor_parallel_size=2, **both)),
                       ref)


def test_stage_processes_use_the_same_fp8_cache(make_pp_llm, random_model, fp8_reference):
    llm = make_pp_llm(model=random_model, pipeline_parallel_size=2, distributed_executor_backend="mp", **FP8)
    try:
        assert llm.engine.model_info().kv_cache_dtype == "float8_e4m3fn"
        assert_same_tokens(run(llm), fp8_reference)
    finally:
        llm.engine.close()
