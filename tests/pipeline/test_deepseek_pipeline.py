"""DeepSeek-V3 (multi-head latent attention, shared experts, the grouped sigmoid router) in the engine:
its KV pages hold latent rows, and chunked prefill, PP 2 (the dense first layers on one stage, the MoE
layers on the other), prefix caching and fp8 latent pages give the unchunked one-device engine's tokens
and logits; nothing compiles after warm-up while steps switch between the absorbed and the rebuilt
prefill form (`mla_attention_auto`: the 120-token prompt's later 64-token chunks rebuild, the first
chunk of every prompt and the decodes attend absorbed; `--mla-prefill flops`, the FLOP rule, so the
forms do not depend on what `auto` measures on the machine). Plus: the engine's greedy tokens equal
transformers' on a folder transformers wrote.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcpp import SamplingParams
from jaxcpp.runtime.compile_guard import forbid_compile
from tests.pipeline.conftest import random_params
from tests.pipeline.test_pipeline_exactness import run

pytestmark = pytest.mark.slow
RANK, ROPE = 32, 8


def assert_same(outs, refs, atol=1e-5):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=atol, rtol=0)


def deepseek_config(**changes):
    from jaxcpp.models.config import ModelConfig

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=ROPE, max_position_embeddings=512, eos_token_ids=(1,),
                  bos_token_id=0, architecture="DeepseekV3ForCausalLM", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, dense_layers=(0, 1), router="sigmoid",
                  topk_method="group_limited", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  n_shared_experts=1, kv_lora_rank=RANK, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=ROPE,
                  v_head_dim=24, rope_interleave=True,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                "mscale": 1.0, "mscale_all_dim": 1.0})
    return ModelConfig(**{**fields, **changes})


def write_random_deepseek(folder) -> str:
    import jax

    from jaxcpp.models.checkpoint import save_hf

    config = deepseek_config()
    params = random_params(config, 5)
    moe = params["layers"][1]["mlp"]["gate"]
    moe["e_score_correction_bias"] = jax.random.normal(jax.random.key(6), moe["e_score_correction_bias"].shape) * 0.5
    save_hf(folder, params, config)
    return str(folder)


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory) -> str:
    return write_random_deepseek(tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="module")
def reference(pp_llm, deepseek_model):
    return run(pp_llm(model=deepseek_model, mla_prefill="flops", enable_chunked_prefill=False,
                      max_num_batched_tokens=128))


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (2, 2)])
def test_layouts_match_single_device_unchunked(pp_llm, deepseek_model, reference, pp, tp):
    """pp 1: chunked prefill (64-token budget) equals the unchunked reference; pp 2: dense | MoE stages;
    tp 2: the latent pages replicated, the heads' projections and the 8 experts (4 a device) split."""
    llm = pp_llm(model=deepseek_model, mla_prefill="flops", pipeline_parallel_size=pp, tensor_parallel_size=tp)
    stages = llm.engine.executor.stages
    for stage in stages:  # one latent row a token a layer: kv_lora_rank + qk_rope_head_dim values
        assert stage.kv.k.shape[2:] == (16, 1, RANK + ROPE) and stage.kv.v.shape[-1] == 0
    if pp == 2:
        assert [len(stage.config.layer_runs(*stage.layers)) for stage in stages] == [1, 1]
        assert "experts" not in stages[0].params["layers"]["mlp"] and "experts" in stages[1].params["layers"]["mlp"]
    with forbid_compile():
        outs = run(llm)
    assert llm.engine.stats().num_compilations_since_warmup == 0
    assert_same(outs, reference, 1e-4 if tp > 1 else 1e-5)  # TP: psums reorder float32 sums (as MoE tests)


def test_pallas_absorbed_kernel_in_the_stages(pp_llm, deepseek_model, reference, monkeypatch):
    """--attention-backend pallas: the stages' absorbed form is the Pallas kernel (interpreted off a GPU),
    decodes and absorbed prefill chunks alike; PP 2 gives the XLA path's tokens."""
    from jaxcpp.kernels import mla_attention

    traced = []
    kernel = mla_attention._kernel
    monkeypatch.setattr(mla_attention, "_kernel", lambda *a, **k: traced.append(1) or kernel(*a, **k))
    llm = pp_llm(model=deepseek_model, mla_prefill="flops", attention_backend="pallas", pipeline_parallel_size=2)
    assert traced  # the stages' programs hold the kernel
    assert_same(run(llm), reference, 1e-4)  # another order of float32 sums


def test_pallas_rebuilt_kernel_in_the_stages(pp_llm, deepseek_model, reference, monkeypatch):
    """--attention-backend pallas --mla-prefill rebuilt: the stages' rebuilt prefill form folds each
    rebuilt KV block in by the Pallas kernel (`kernels/mla_rebuilt.py`, interpreted off a GPU); PP 2
    gives the XLA path's tokens."""
    from jaxcpp.kernels import mla_rebuilt

    traced = []
    kernel = mla_rebuilt._fold_kernel
    monkeypatch.setattr(mla_rebuilt, "_fold_kernel", lambda *a, **k: traced.append(1) or kernel(*a, **k))
    mla_rebuilt.mla_prefill_rebuilt_attention.clear_cache()  # an earlier engine's trace would hide the kernel
    llm = pp_llm(model=deepseek_model, mla_prefill="rebuilt", attention_backend="pallas", pipeline_parallel_size=2)
    assert traced  # the stages' programs hold the kernel
    assert_same(run(llm), reference, 1e-4)  # another order of float32 sums


def test_stage_processes_match_in_process(make_pp_llm, deepseek_model, reference):
    llm = make_pp_llm(model=deepseek_model, mla_prefill="flops", pipeline_parallel_size=2,
                      distributed_executor_backend="mp")
    try:
        assert_same(run(llm), reference)
    finally:
        llm.engine.close()


def test_prefix_caching_on_latent_pages(pp_llm, deepseek_model, reference):
    """A second run of the same prompts reuses their cached latent pages and gives the same tokens."""
    llm = pp_llm(model=deepseek_model, mla_prefill="flops", enable_prefix_caching=True)
    first = run(llm)
    hits = llm.engine.stats().num_prefix_cache_hit_tokens_total
    again = run(llm)
    assert_same(first, reference)
    assert_same(again, reference)
    assert llm.engine.stats().num_prefix_cache_hit_tokens_total - hits >= 160  # whole pages of the 4 prompts

def test_fp8_latent_pages(pp_llm, deepseek_model, reference):
    """--kv-cache-dtype fp8: latent rows stored in float8_e4m3 (one scale a layer), PP 2 equals PP 1."""
    one = run(pp_llm(model=deepseek_model, mla_prefill="flops", kv_cache_dtype="fp8"))
    llm = pp_llm(model=deepseek_model, mla_prefill="flops", kv_cache_dtype="fp8", pipeline_parallel_size=2)
    assert llm.engine.executor.stages[0].kv.k.dtype == jnp.float8_e4m3fn
    assert_same(run(llm), one, 1e-2)
    for out, ref in zip(one, reference, strict=True):  # the first token's logits (before tokens may part):
        np.testing.assert_allclose(out.logits[0], ref.logits[0], atol=0.5, rtol=0)  # fp8 rounding of the rows


def test_engine_greedy_equals_transformers(make_pp_llm, tmp_path):
    """The whole engine (paged latent cache, chunked prefill of a 40-token prompt in 16-token chunks:
    absorbed and rebuilt steps) on a folder transformers wrote: transformers' greedy tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = deepseek_config(eos_token_ids=(), bos_token_id=None, num_hidden_layers=2, dense_layers=(0,),
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           "mscale": 1.0, "mscale_all_dim": 0.7})
    hf = {k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("deepseek_v3", **hf), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn_like(b))
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompt = [int(t) for t in np.random.default_rng(3).integers(2, 128, 40)]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    llm = make_pp_llm(model=str(tmp_path), mla_prefill="flops", max_model_len=64, max_num_batched_tokens=16)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                                   ignore_eos=True))
    assert out[0].token_ids == want
