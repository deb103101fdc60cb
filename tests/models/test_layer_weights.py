"""Per-layer weights (what a CPU stage holds, `runs.unstack_layers`) against stacked ones (one scan a run):
the same logits (to 1e-6) and the same written pages (bitwise for a dense model; float32 rounding apart where
unlike runs meet), for a dense Llama, a Qwen3-MoE model whose layers
are two runs (a dense layer, then sparse ones) and a DeepSeek-V3 (MLA) model with a dense run and a
sparse run. Prefill in two chunks, then a decode batched with another prompt's prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_metadata import build_metadata

from jaxcpp.models import llama, runs
from jaxcpp.models.config import ModelConfig
from tests.pipeline.conftest import random_params

PAGE, T, NUM_PAGES = 4, 32, 24
BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128)
CONFIGS = {
    "llama": ModelConfig(**BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=12, attention_bias=True),
    "qwen3-moe-mixed": ModelConfig(**BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=12,
                                   architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                   dense_layers=(0,)),
    "deepseek-v3": ModelConfig(**BASE, num_hidden_layers=3, num_key_value_heads=4, head_dim=8,
                               architecture="DeepseekV3ForCausalLM", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, norm_topk_prob=True, dense_layers=(0,), router="sigmoid",
                               topk_method="group_limited", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                               n_shared_experts=1, kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=12,
                               qk_rope_head_dim=8, v_head_dim=20, rope_interleave=True),
}


def steps(params, config):
    """Logits of every real token of three steps, and the pages they wrote."""

    @jax.jit
    def step(params, ids, kv, md):  # params as arguments, as a stage's programs take them
        hidden, kv = llama.run_layers(params["layers"], llama.embed(params, ids), kv, md, config)
        return llama.compute_logits(params, hidden, config), kv

    rng = np.random.default_rng(0)
    a, b = (list(map(int, rng.integers(0, config.vocab_size, n))) for n in (21, 9))
    pages_a, pages_b = [3, 1, 7, 5, 9, 2], [11, 4, 13]
    kv = llama.make_kv_cache(config, config.num_hidden_layers, NUM_PAGES, PAGE)
    logits = []
    for ids, chunks in ((a[:12], [(pages_a, 0, 12)]), (a[12:20], [(pages_a, 12, 8)]),
                        ([a[20], *b], [(pages_a, 20, 1), (pages_b, 0, 9)])):
        out, kv = step(params, jnp.asarray(ids + [0] * (T - len(ids)), jnp.int32), kv, build_metadata(chunks, T, PAGE))
        logits.append(np.asarray(out[:len(ids)]))
    return np.concatenate(logits), kv


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_layer_weights_equal_stacked(name):
    config = CONFIGS[name]
    params = random_params(config, 0)
    per_layer = {**params, "layers": runs.unstack_layers(params["layers"])}
    lengths = [len(run) for run in per_layer["layers"]]
    assert lengths == ([3] if name == "llama" else [1, 2])  # a dense layer, then two sparse ones
    assert runs.num_layers_of(per_layer["layers"]) == 3
    if name != "llama":
        assert [runs.is_moe_run(run) for run in per_layer["layers"]] == [False, True]
    want, want_kv = steps(params, config)
    got, got_kv = steps(per_layer, config)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # A dense model's pages are bitwise the same. Where a run of one kind ends and the next begins, XLA
    # fuses the unrolled layers' float32 ops differently from the scan body's: pages one or two ulp apart
    # (measured up to 2.6e-6 on values of size ~5), the logits still within 1e-6.
    for field in ("k", "v"):
        got_pages, want_pages = np.asarray(getattr(got_kv, field)), np.asarray(getattr(want_kv, field))
        np.testing.assert_allclose(got_pages, want_pages, atol=0 if name == "llama" else 1e-5, rtol=0)
    assert np.abs(np.asarray(got_kv.k)).sum() > 0
