"""The pieces every family's decoder layer is built from: RoPE, RMSNorm, Linear and the SwiGLU MLP."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.models.config import ModelConfig

INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: ModelConfig) -> np.ndarray:  # [head_dim // 2] float32
    """Inverse frequencies exactly as transformers computes them (float32), incl. linear/llama3 scaling."""
    f32 = np.float32
    dim = config.head_dim
    inv_freq = f32(1.0) / (f32(config.rope_theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = f32(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low, high = f32(scaling["low_freq_factor"]), f32(scaling["high_freq_factor"])
    old_len = f32(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = f32(2 * np.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (f32(1.0) - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(f32)


def apply_rope(
    x: jax.Array,  # [..., T, H, Dh]
    positions: jax.Array,  # [T] or [..., T] int32
    inv_freq: np.ndarray,  # [Dh // 2] float32
) -> jax.Array:  # [..., T, H, Dh]
    """Rotate-half RoPE (the Hugging Face Llama layout): angles in float32, then cast to x's dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, Dh]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# --------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)  # [D]
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def _dense(features: int, use_bias: bool, param_dtype: Any, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, param_dtype=param_dtype, name=name,
                    kernel_init=nn.initializers.normal(INIT_STD))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig
    param_dtype: Any = jnp.float32
    width: int | None = None  # default: intermediate_size (DeepSeek's shared experts: their own)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        c, dt = self.config, self.param_dtype
        width = self.width or c.intermediate_size
        gate = _dense(width, False, dt, "gate_proj")(x)
        up = _dense(width, False, dt, "up_proj")(x)
        return _dense(c.hidden_size, False, dt, "down_proj")(nn.silu(gate) * up)
