"""FP8 KV pages: the quantizing write and every attention path's dequantizing read.

The cast is checked against ml_dtypes' reference casts (round to nearest even, clipped to the finite
range), and each attention path reading fp8 pages with scales must give what the reference gives on
float32 pages holding the dequantized values: dequantization is exact in float32, so the only
difference is float32 summation order (1e-5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels.ragged_paged_attention import (
    dequantize_kv,
    quantize_kv,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
    write_kv_pages,
)

FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
SCALES = (1.0, 0.37, 3.5)


def reference_quantize(x: np.ndarray, scale: float, dtype) -> np.ndarray:
    """ml_dtypes' cast of x / scale (float32), clipped to the format's finite range."""
    limit = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x.astype(np.float32) / np.float32(scale), -limit, limit).astype(dtype)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_matches_ml_dtypes_cast(name, scale):
    dtype = FP8[name]
    rng = np.random.default_rng(1)
    limit = float(ml_dtypes.finfo(dtype).max)
    x = np.concatenate([
        rng.standard_normal(4096) * 4,                         # the bulk
        rng.standard_normal(512) * 1e-4,                       # subnormals and zero
        np.array([limit, -limit, 2 * limit, -3 * limit]) * scale,  # the edge and beyond: clipped, never NaN
        rng.uniform(-limit, limit, 512) * scale,
    ]).astype(np.float32)
    got = np.asarray(jax.jit(quantize_kv, static_argnums=2)(jnp.asarray(x), scale, jnp.dtype(name)))
    want = reference_quantize(x, scale, dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit
    assert np.isfinite(got.astype(np.float32)).all()
    back = np.asarray(dequantize_kv(jnp.asarray(got), scale))
    np.testing.assert_array_equal(back, want.astype(np.float32) * np.float32(scale))


@pytest.mark.parametrize("name", FP8)
def test_round_trip_error_is_at_most_half_a_step(name):
    """Inside the normal range, |dequantize(quantize(x)) - x| <= half a quantization step of x."""
    dtype = FP8[name]
    mantissa_bits = ml_dtypes.finfo(dtype).nmant
    x = np.random.default_rng(2).uniform(0.05, 200, 4096).astype(np.float32) * np.sign(
        np.random.default_rng(3).standard_normal(4096)).astype(np.float32)
    scale = 0.5
    back = np.asarray(dequantize_kv(quantize_kv(jnp.asarray(x), scale, jnp.dtype(name)), scale))
    step = 2.0 ** (np.floor(np.log2(np.abs(x))) - mantissa_bits)  # spacing of the format around x
    assert np.all(np.abs(back - x) <= step / 2 + 1e-12)


def test_write_stores_quantized_values_and_touches_nothing_else():
    k_pages = jnp.zeros((4, 8, 2, 16), jnp.float8_e4m3fn)
    v_pages = jnp.zeros_like(k_pages)
    rng = np.random.default_rng(4)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 16)) * 20, jnp.float32) for _ in range(2))
    slots = jnp.asarray([9, 10, 17, 31, 0], jnp.int32)
    scales = jnp.asarray([0.25, 2.0], jnp.float32)
    k_new, v_new = write_kv_pages(k_pages, v_pages, k, v, slots, scales)
    flat_k = np.asarray(k_new).reshape(32, 2, 16)
    flat_v = np.asarray(v_new).reshape(32, 2, 16)
    np.testing.assert_array_equal(flat_k[[9, 10, 17, 31, 0]].view(np.uint8),
                                  reference_quantize(np.asarray(k), 0.25, ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(flat_v[[9, 10, 17, 31, 0]].view(np.uint8),
                                  reference_quantize(np.asarray(v), 2.0, ml_dtypes.float8_e4m3fn).view(np.uint8))
    untouched = np.setdiff1d(np.arange(32), [9, 10, 17, 31, 0])
    assert not flat_k[untouched].astype(np.float32).any() and not flat_v[untouched].astype(np.float32).any()


MIXES = {
    "mixed": ([1, 1, 1, 29, 23, 50], [0, 77, 290, 0, 180, 3]),
    "decode_only": ([1] * 6, [0, 5, 15, 63, 150, 299]),
    "one_long_chunk": ([64], [300]),
}
PAGE_SIZE, GROUP = 16, 2


def fp8_batch(mix: str, name: str, scales: tuple[float, float]):
    q, k_pages, v_pages, md = ragged_batch(*MIXES[mix], num_tokens=128, num_seqs=16, max_kv_len=512,
                                           num_kv_heads=2, head_dim=32, page_size=PAGE_SIZE, group=GROUP,
                                           dtype=jnp.float32)
    kq = quantize_kv(k_pages * 3, scales[0], jnp.dtype(name))
    vq = quantize_kv(v_pages * 3, scales[1], jnp.dtype(name))
    return q, kq, vq, md


PATHS = {
    "reference": ragged_paged_attention_reference,
    "xla": ragged_paged_attention_xla,
    "pallas_interpret": functools.partial(ragged_paged_attention, interpret=True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", FP8)
def test_attention_on_fp8_pages_equals_attention_on_dequantized_pages(path, name):
    scales = (0.37, 2.5)
    # partials: jit's cache is per function, and other tests count the plain functions' compilations
    attention = jax.jit(functools.partial(PATHS[path]))
    reference = jax.jit(functools.partial(ragged_paged_attention_reference))
    kv_scales = jnp.asarray(scales, jnp.float32)
    for mix in MIXES:
        q, kq, vq, md = fp8_batch(mix, name, scales)
        got = attention(q, kq, vq, md, kv_scales)
        want = reference(q, dequantize_kv(kq, scales[0]), dequantize_kv(vq, scales[1]), md)
        assert got.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=f"{mix}")


def test_pallas_without_scales_is_unchanged_by_unit_scales():
    """Float pages: no scales and scales of 1 give the same output bit for bit (the multiply by 1 is exact)."""
    q, k_pages, v_pages, md = ragged_batch(*MIXES["mixed"], num_tokens=128, num_seqs=16, max_kv_len=512,
                                           num_kv_heads=2, head_dim=32, page_size=PAGE_SIZE, group=GROUP,
                                           dtype=jnp.float32)
    kernel = jax.jit(functools.partial(ragged_paged_attention, interpret=True))
    plain = kernel(q, k_pages, v_pages, md)
    ones = kernel(q, k_pages, v_pages, md, jnp.ones(2, jnp.float32))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(ones))
