"""The paged functional API (`forward` + `compute_logits`) against plain causal `forward_dense`, float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_metadata import build_metadata

from jaxcpp.models import llama
from jaxcpp.models.config import LlamaConfig

PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ = 4, 32, 8
T = 32  # one token bucket for every step, so each jitted function compiles once

CONFIG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     max_position_embeddings=64, attention_bias=True,
                     rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def metadata(chunks, num_tokens_padded):
    return build_metadata(chunks, num_tokens_padded, PAGE_SIZE, PAGES_PER_SEQ)


@pytest.fixture(scope="module")
def params():
    p = llama.init_params(CONFIG, jax.random.key(0))
    # Non-trivial norms and biases so that every parameter matters.
    leaves, tree = jax.tree_util.tree_flatten(p)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                               for x, k in zip(leaves, keys, strict=True)])


@jax.jit
def paged_step(params, token_ids, kv, md):
    hidden, kv = llama.forward(params, token_ids, kv, md, CONFIG)
    return llama.compute_logits(params, hidden, CONFIG), kv


dense = jax.jit(llama.forward_dense, static_argnums=2)


def dense_logits(params, tokens):
    """Causal, so padding after the tokens changes nothing before them."""
    return np.asarray(dense(params, pad(tokens)[None], CONFIG)[0, :len(tokens)])


def pad(tokens, n=T):
    return jnp.asarray(list(tokens) + [0] * (n - len(tokens)), jnp.int32)


def test_shapes_and_stacking(params):
    assert params["layers"]["self_attn"]["q_proj"]["kernel"].shape == (2, 64, 64)
    assert params["layers"]["self_attn"]["k_proj"]["bias"].shape == (2, 32)
    assert "bias" in params["layers"]["self_attn"]["o_proj"]  # Llama's attention_bias covers o_proj
    qwen2 = llama.init_params(CONFIG.replace(architecture="Qwen2ForCausalLM"), jax.random.key(0))
    assert "bias" not in qwen2["layers"]["self_attn"]["o_proj"]  # Qwen2's does not
    tied = llama.init_params(CONFIG.replace(tie_word_embeddings=True), jax.random.key(0), jnp.bfloat16)
    assert "lm_head" not in tied and tied["embed"].dtype == jnp.bfloat16


def test_single_prefill_matches_dense(params):
    tokens = list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, 21))
    kv = llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE, jnp.float32)
    md = metadata([([3, 5, 7, 9, 11, 13], 0, 21)], T)
    logits, kv = paged_step(params, pad(tokens), kv, md)
    np.testing.assert_allclose(np.asarray(logits[:21]), dense_logits(params, tokens), atol=1e-5, rtol=1e-5)
    assert kv.k.shape == (2, NUM_PAGES, PAGE_SIZE, 2, 16)
    assert float(jnp.abs(kv.k[:, 3]).sum()) > 0 and float(jnp.abs(kv.k[:, 4]).sum()) == 0


def test_chunked_prefill_then_mixed_decode_batch(params):
    """Two chunks of one prompt, then its decode batched with another prompt's prefill."""
    rng = np.random.default_rng(1)
    a = list(rng.integers(0, CONFIG.vocab_size, 14))
    b = list(rng.integers(0, CONFIG.vocab_size, 9))
    pages_a, pages_b = [2, 6, 4, 8], [10, 1, 12]
    kv = llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE, jnp.float32)
    out1, kv = paged_step(params, pad(a[:6]), kv, metadata([(pages_a, 0, 6)], T))
    out2, kv = paged_step(params, pad(a[6:13]), kv, metadata([(pages_a, 6, 7)], T))
    # decode a's 14th token together with b's whole prompt
    out3, kv = paged_step(params, pad([a[13], *b]), kv, metadata([(pages_a, 13, 1), (pages_b, 0, 9)], T))
    ref_a, ref_b = dense_logits(params, a), dense_logits(params, b)
    got_a = np.concatenate([out1[:6], out2[:7], out3[:1]])
    np.testing.assert_allclose(got_a, ref_a, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out3[1:10]), ref_b, atol=1e-5, rtol=1e-5)


def test_stage_slices_compose(params):
    """Running layers [0:1] then [1:2] on their own caches equals running both: what a pipeline does."""
    tokens = list(np.random.default_rng(2).integers(0, CONFIG.vocab_size, 10))
    md = metadata([([1, 2, 3], 0, 10)], T)
    ids = pad(tokens)
    hidden = llama.embed(params, ids)
    run_stage = jax.jit(llama.run_layers, static_argnums=4)
    for start in range(2):
        stage = jax.tree_util.tree_map(lambda x, s=start: x[s:s + 1], params["layers"])
        kv = llama.make_kv_cache(CONFIG, 1, NUM_PAGES, PAGE_SIZE, jnp.float32)
        hidden, _ = run_stage(stage, hidden, kv, md, CONFIG)
    full, _ = paged_step(params, ids, llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE, jnp.float32), md)
    staged = llama.compute_logits(params, hidden, CONFIG)
    np.testing.assert_allclose(np.asarray(staged[:10]), np.asarray(full[:10]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="KV cache holds 1 layers"):
        llama.run_layers(params["layers"], hidden, kv, md, CONFIG)


def test_bfloat16_weights_run(params):
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = list(range(1, 12))
    kv = llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
    logits, kv = paged_step(p16, pad(tokens), kv, metadata([([1, 2, 3], 0, 11)], T))
    assert logits.dtype == jnp.float32 and kv.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(logits[:11]), dense_logits(params, tokens), atol=0.1)
