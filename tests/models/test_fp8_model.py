"""The model with 8-bit storage: fp8 KV pages (chunked vs unchunked, calculated scales) and fp8 weights."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paged_metadata import build_metadata

from jaxcpp.models import llama
from jaxcpp.models.checkpoint import quantize_fp8_per_channel
from jaxcpp.models.config import LlamaConfig

PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ = 4, 32, 8
T = 32
CONFIG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


@pytest.fixture(scope="module")
def params():
    p = llama.init_params(CONFIG, jax.random.key(0))
    return jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)  # K/V well above 1


@jax.jit
def paged_step(params, token_ids, kv, md):
    hidden, kv = llama.forward(params, token_ids, kv, md, CONFIG)
    return llama.compute_logits(params, hidden, CONFIG), kv


def pad(tokens):
    return jnp.asarray(list(tokens) + [0] * (T - len(tokens)), jnp.int32)


def md(chunks):
    return build_metadata(chunks, T, PAGE_SIZE, PAGES_PER_SEQ)


def fp8_cache(name, k_scale=None, v_scale=None):
    return llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE, jnp.dtype(name), k_scale, v_scale)


def one_step_apart(a: np.ndarray, b: np.ndarray, dtype) -> bool:
    """Every pair of stored fp8 values equal or neighbours (one quantization step apart)."""
    ia = a.view(np.uint8).astype(np.int16)
    ib = b.view(np.uint8).astype(np.int16)
    same_sign = (ia & 0x80) == (ib & 0x80)
    neighbours = same_sign & (np.abs((ia & 0x7F) - (ib & 0x7F)) <= 1)
    zero_pair = (a.astype(np.float32) == 0) | (b.astype(np.float32) == 0)  # +0 / -0 / smallest subnormal
    return bool(np.all(neighbours | (zero_pair & (np.abs((ia & 0x7F) + (ib & 0x7F)) <= 1))))


@pytest.mark.parametrize("name", FP8)
def test_chunked_equals_unchunked_with_fp8_pages(params, name):
    """Greedy tokens identical; the pages differ by at most one quantization step (the chunked run's K/V
    may round differently before the cast)."""
    tokens = list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, 22))
    pages = [3, 9, 5, 11, 7, 2]
    scales = (jnp.asarray([0.5, 2.0]), jnp.asarray([1.5, 0.25]))
    whole, kv_whole = paged_step(params, pad(tokens), fp8_cache(name, *scales), md([(pages, 0, 22)]))
    kv = fp8_cache(name, *scales)
    parts = []
    for start, n in ((0, 5), (5, 9), (14, 8)):
        out, kv = paged_step(params, pad(tokens[start:start + n]), kv, md([(pages, start, n)]))
        parts.append(np.asarray(out[:n]))
    chunked = np.concatenate(parts)
    assert kv.k.dtype == jnp.dtype(name)
    np.testing.assert_array_equal(chunked.argmax(-1), np.asarray(whole[:22]).argmax(-1))
    np.testing.assert_allclose(chunked, np.asarray(whole[:22]), atol=1e-3)
    for a, b in ((kv.k, kv_whole.k), (kv.v, kv_whole.v)):
        assert one_step_apart(np.asarray(a), np.asarray(b), FP8[name])
    np.testing.assert_array_equal(np.asarray(kv.k_scale), [0.5, 2.0])  # given scales stay


def test_fp8_pages_close_to_float_pages(params):
    """The fp8 cache only rounds K and V: logits stay near the float32 cache's."""
    tokens = list(np.random.default_rng(1).integers(0, CONFIG.vocab_size, 20))
    m = md([([1, 2, 3, 4, 5], 0, 20)])
    full, _ = paged_step(params, pad(tokens), llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE), m)
    e4m3, _ = paged_step(params, pad(tokens), fp8_cache("float8_e4m3fn"), m)
    err = float(jnp.max(jnp.abs(full[:20] - e4m3[:20])))
    assert 0 < err < 0.1 * float(jnp.max(jnp.abs(full[:20])))


def test_calculated_scales_come_from_the_first_prefill(params):
    """Scales start at 0 ("calculate"); the first step with real tokens sets each layer's to its largest
    |K| (|V|) over the real tokens / (448 / 2); a later step keeps them."""
    tokens = list(np.random.default_rng(2).integers(0, CONFIG.vocab_size, 13))
    m = md([([6, 7, 8, 9], 0, 13)])
    run = jax.jit(lambda p, ids, kv, m: llama.run_layers(p["layers"], llama.embed(p, ids), kv, m, CONFIG,
                                                         calculate_kv_scales=True))
    zeros = jnp.zeros(2, jnp.float32)
    kv0 = fp8_cache("float8_e4m3fn", zeros, zeros)
    padding_only = build_metadata([], T, PAGE_SIZE, PAGES_PER_SEQ)
    _, kv0 = run(params, pad([]), kv0, padding_only)
    assert not np.asarray(kv0.k_scale).any()  # no real token yet: still to be calculated
    assert np.isfinite(np.asarray(kv0.k, np.float32)).all()
    _, kv = run(params, pad(tokens), kv0, m)
    # the float32 cache holds the exact K/V of those tokens
    _, exact = paged_step(params, pad(tokens), llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE), m)
    slots = np.asarray(m.slot_mapping[:13])
    for layer, rtol in ((0, 1e-6), (1, 0.05)):  # layer 1's input already saw layer 0's fp8 pages
        for got, full in ((kv.k_scale, exact.k), (kv.v_scale, exact.v)):
            stored = np.asarray(full[layer]).reshape(-1, 2, 16)[slots]
            np.testing.assert_allclose(float(got[layer]), np.abs(stored).max() / 224.0, rtol=rtol)
    later = list(np.random.default_rng(3).integers(0, CONFIG.vocab_size, 5))
    _, kv2 = run(params, pad(later), kv, md([([10, 11], 0, 5)]))
    np.testing.assert_array_equal(np.asarray(kv2.k_scale), np.asarray(kv.k_scale))


def fp8_params(params):
    """Decoder-layer kernels quantized per output channel, as `--quantization fp8` loads them."""
    out = jax.tree_util.tree_map(np.asarray, params)

    def walk(tree):
        for sub in list(tree.values()):
            if isinstance(sub, dict) and "kernel" in sub:
                sub["kernel"], sub["kernel_scale"] = quantize_fp8_per_channel(sub["kernel"])
            elif isinstance(sub, dict):
                walk(sub)

    walk(out["layers"])
    return out


def test_fp8_weights_forward_equals_dequantized_float_weights(params):
    q = fp8_params(params)
    assert q["layers"]["mlp"]["down_proj"]["kernel"].dtype == ml_dtypes.float8_e4m3fn
    assert q["layers"]["mlp"]["down_proj"]["kernel_scale"].shape == (2, CONFIG.hidden_size)
    deq = jax.tree_util.tree_map(lambda x: x, q)
    deq["layers"] = llama.dequantize_weights(q["layers"], jnp.float32)
    assert "kernel_scale" not in deq["layers"]["mlp"]["down_proj"]
    tokens = list(np.random.default_rng(4).integers(0, CONFIG.vocab_size, 16))
    m = md([([1, 2, 3, 4], 0, 16)])
    cache = llama.make_kv_cache(CONFIG, 2, NUM_PAGES, PAGE_SIZE)
    got, _ = paged_step(q, pad(tokens), cache, m)
    want, _ = paged_step(deq, pad(tokens), cache, m)
    np.testing.assert_allclose(np.asarray(got[:16]), np.asarray(want[:16]), atol=1e-5, rtol=1e-5)
    full, _ = paged_step(params, pad(tokens), cache, m)
    rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))  # noqa: E731
    assert 0 < rms(got[:16] - full[:16]) < 0.15 * rms(full[:16])  # e4m3 rounds each weight by <= 1/16


def test_per_channel_quantization_matches_the_reference_cast():
    w = np.random.default_rng(5).standard_normal((3, 40, 24)).astype(np.float32)
    w[1, :, 7] = 0  # a channel of zeros: scale 1, all zeros
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (3, 24)
    np.testing.assert_allclose(scale[0], np.abs(w[0]).max(axis=0) / 448.0, rtol=1e-7)
    assert scale[1, 7] == 1.0 and not q[1, :, 7].astype(np.float32).any()
    want = (w / scale[:, None, :]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
    assert np.abs(q.astype(np.float32)).max(axis=1).max() == 448.0  # each channel's max reaches the top
