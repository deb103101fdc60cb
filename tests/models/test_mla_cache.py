"""The MLA model over its latent pages without transformers: the paged path (prefill in two chunks,
then a decode: rebuilt, absorbed and absorbed-decode steps) equals the dense path on our own random
DeepSeek-V3 config; the cache holds one latent row a token a layer; fp8 latent pages with scales
calculated from the first prefill (`--calculate-kv-scales`) stay close to float pages."""

import jax
import jax.numpy as jnp
import numpy as np
from paged_metadata import build_metadata

from jaxcpp.core.sizing import kv_values_per_token
from jaxcpp.models import llama
from jaxcpp.models.config import ModelConfig
from tests.pipeline.conftest import random_params

PAGE, T = 4, 32
CONFIG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=128,
                     architecture="DeepseekV3ForCausalLM", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, norm_topk_prob=True, dense_layers=(0,), router="sigmoid",
                     topk_method="group_limited", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     n_shared_experts=1, kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                     v_head_dim=20, rope_interleave=True)


def paged_logits(params, ids, kv, calculate_kv_scales=False):
    """Prefill ids[:20] as chunks of 12 (rebuilt, L = 0) and 8 (absorbed at this shape), then decode ids[20]."""
    pages = list(range(1, 9))

    @jax.jit
    def step(ids, kv, md):
        hidden, kv = llama.run_layers(params["layers"], llama.embed(params, ids), kv, md, CONFIG,
                                      calculate_kv_scales=calculate_kv_scales)
        return llama.compute_logits(params, hidden, CONFIG), kv

    out = []
    for start, n in ((0, 12), (12, 8), (20, 1)):
        chunk = jnp.asarray(ids[start:start + n] + [0] * (T - n), jnp.int32)
        logits, kv = step(chunk, kv, build_metadata([(pages, start, n)], T, PAGE))
        out.append(np.asarray(logits[:n]))
    return np.concatenate(out), kv


def test_paged_latent_path_equals_dense_and_holds_latent_rows():
    params = random_params(CONFIG, 0)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 96, 21)]
    kv = llama.make_kv_cache(CONFIG, 2, 16, PAGE)
    assert kv.k.shape == (2, 16, PAGE, 1, 24 + 8) and kv.v.size == 0
    assert kv_values_per_token(CONFIG) == kv.k.shape[-1]  # sizing counts what the pages hold
    got, kv = paged_logits(params, ids, kv)
    want = np.asarray(llama.forward_dense(params, jnp.asarray([ids], jnp.int32), CONFIG))[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(np.asarray(kv.k[:, 1:6])).sum() > 0 and np.all(np.asarray(kv.k[:, 7:]) == 0)  # 21 tokens: pages 1-6


def test_fp8_latent_pages_with_calculated_scales():
    params = llama.init_params(CONFIG, jax.random.key(1))
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 96, 21)]
    exact, _ = paged_logits(params, ids, llama.make_kv_cache(CONFIG, 2, 16, PAGE))
    zeros = np.zeros(2, np.float32)
    fp8 = llama.make_kv_cache(CONFIG, 2, 16, PAGE, jnp.float8_e4m3fn, zeros, zeros)
    got, kv = paged_logits(params, ids, fp8, calculate_kv_scales=True)
    scales = np.asarray(kv.k_scale)
    assert (scales > 0).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, exact, atol=0.05 * np.abs(exact).max(), rtol=0)
