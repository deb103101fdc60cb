"""Mixture-of-experts models under the pipeline: PP and PP x TP (experts split over "tp") give the one-device
engine's tokens and logits; chunked prefill equals unchunked; nothing compiles after warm-up while the
routing changes from step to step; stage processes equal in-process.

The Qwen3-MoE model has a dense layer among its sparse ones (`mlp_only_layers`), so with PP 2 the first
stage holds two runs of unlike layers (MoE, dense) and the second one run; 4 experts over TP 2 are 2 a
device. The Mixtral model is MoE throughout. The Qwen2-MoE model adds q/k/v biases and a gated shared
expert beside the routed ones.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcpp.runtime.compile_guard import forbid_compile
from tests.pipeline.conftest import random_params
from tests.pipeline.test_pipeline_exactness import run

pytestmark = pytest.mark.slow
# Expert parallelism adds each token's expert outputs across devices (a psum) where one device adds them
# in its own order, on top of TP's row-parallel all-reduces: float32 rounding (one MoE block: 1.1e-5 on
# outputs of size 36, 3e-7 relative), carried through 4 layers and 8 decode steps of a model with weights
# scaled x3 (measured up to 5.7e-5 on logits of size ~1), above the dense layouts' 1e-5. Tokens: identical.
TP_ATOL = 1e-4


def assert_same(outs, refs, atol=1e-5):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=atol, rtol=0)


def write_random_moe(folder, architecture: str) -> str:
    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import ModelConfig

    qwen3, qwen2 = architecture == "Qwen3MoeForCausalLM", architecture == "Qwen2MoeForCausalLM"
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_ids=(1,), bos_token_id=0, architecture=architecture, qk_norm=qwen3,
                         attention_bias=qwen2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                         norm_topk_prob=True, dense_layers=(1,) if qwen3 or qwen2 else (),
                         shared_expert_intermediate_size=40 if qwen2 else 0)
    save_hf(folder, random_params(config, 11), config)
    return str(folder)


@pytest.fixture(scope="module", params=["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def moe_model(request, tmp_path_factory) -> str:
    return write_random_moe(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def moe_reference(pp_llm, moe_model):
    return run(pp_llm(model=moe_model, enable_chunked_prefill=False, max_num_batched_tokens=128))


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (2, 2)])
def test_moe_layouts_match_single_device_unchunked(pp_llm, moe_model, moe_reference, pp, tp):
    """(1, 1): chunked prefill (64-token budget) equals the unchunked reference; (2, 2): experts split
    (and Qwen2-MoE's shared expert split by columns, as a dense MLP)."""
    if "Qwen2Moe" in moe_model and tp == 1:
        pytest.skip("Qwen2-MoE's own part is its shared expert: the split layout covers it")
    llm = pp_llm(model=moe_model, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    if tp == 2:
        stage = llm.engine.executor.stages[0]
        runs = stage.params["layers"]
        mlp = (runs[0] if isinstance(runs, list) else runs)["mlp"]
        experts = mlp["experts"]["gate_proj"]["kernel"]
        assert experts.sharding.shard_shape(experts.shape)[1] == 2  # [L, E/tp, D, I]: 2 experts a device
        if "shared_expert" in mlp:  # Qwen2-MoE: [L, D, 40] split by columns, 20 a device
            shared = mlp["shared_expert"]["gate_proj"]["kernel"]
            assert shared.sharding.shard_shape(shared.shape)[-1] == 20
    with forbid_compile():  # 4 prompts, chunks and decodes: the routing differs every step
        outs = run(llm)
    assert llm.engine.stats().num_compilations_since_warmup == 0
    assert_same(outs, moe_reference, TP_ATOL if tp > 1 else 1e-5)


def test_moe_stage_processes_match_in_process(make_pp_llm, moe_model, moe_reference):
    if "Qwen3Moe" not in moe_model:
        pytest.skip("one family is enough for the stage processes (Qwen3-MoE: both kinds of layer)")
    llm = make_pp_llm(model=moe_model, pipeline_parallel_size=2, tensor_parallel_size=2,
                      distributed_executor_backend="mp")
    try:
        assert_same(run(llm), moe_reference, TP_ATOL)
    finally:
        llm.engine.close()


def test_fp8_experts_and_fp8_pages_split_over_tp(pp_llm, moe_model):
    """--quantization fp8 (every expert's projections too, per channel per expert) with an fp8 KV cache:
    PP 2 x TP 2, experts split, gives the one-device fp8 engine's tokens."""
    if "Qwen3Moe" not in moe_model:
        pytest.skip("one family is enough here")
    fp8 = dict(quantization="fp8", kv_cache_dtype="fp8")
    ref = run(pp_llm(model=moe_model, **fp8))
    llm = pp_llm(model=moe_model, pipeline_parallel_size=2, tensor_parallel_size=2, **fp8)
    kernel = llm.engine.executor.stages[1].params["layers"]["mlp"]["experts"]["up_proj"]["kernel"]
    assert kernel.dtype == jnp.float8_e4m3fn and kernel.sharding.shard_shape(kernel.shape)[1] == 2
    with forbid_compile():
        outs = run(llm)
    assert_same(outs, ref, 1e-2)  # the fp8 pipeline tests' bound: a K/V value one fp8 step apart (8e-4 here)
