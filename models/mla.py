"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) and DeepSeek's MoE block, computed as
transformers' modeling_deepseek_v3.py / modeling_deepseek_v2.py do.

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) without q LoRA: V2-Lite)  [T, H, dn + dr]
    c, k_pe  = kv_a_proj_with_mqa(x) split (r, dr);  c = kv_a_layernorm(c)              one row a token
    q_pe, k_pe roped (YaRN with DeepSeek's mscale, interleaved pairs where the config says)
    per head: k = [c @ W_UK_h, k_pe], v = c @ W_UV_h  (kv_b_proj = [W_UK | W_UV] per head)
    softmax scale (dn + dr)^-1/2 · mscale(factor, mscale_all_dim)^2, then o_proj

The module hands (q_nope, q_pe, c, k_pe, W_UK, W_UV) to the caller's `attend`, which either rebuilds
per-head K/V (`dense_mla_attention`: training, tests) or writes (c, k_pe) into latent pages and attends
there (`jaxcpp.kernels.mla_attention`: absorbed decodes, absorbed or rebuilt prefill chunks). The model
knows nothing of pages.

Interleaved RoPE: transformers' V3 rotates pairs (x0, x1), (x2, x3), ... and writes the results
de-interleaved ([even..., odd...]); V2 rotates the same pairs as complex numbers and keeps them
interleaved. Both equal rotate-half RoPE on the de-interleaved vector, up to one permutation of the
rope dims applied to q and k alike, which leaves every q.k (and so the output) unchanged: that is what
this file computes, and what the latent pages store.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.chunking.mla_cost import MlaShape
from jaxcpp.kernels.mla_attention import (
    AbsorbedFn,
    RebuiltFn,
    mla_absorbed_xla,
    mla_attention_auto,
    mla_prefill_rebuilt_xla,
    write_latent_pages,
)
from jaxcpp.models.config import ModelConfig
from jaxcpp.models.layers import MLP, RMSNorm, _dense, apply_rope, rope_inv_freq
from jaxcpp.models.moe import Experts, ExpertsFn, Kernel, grouped_experts

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps

# attend(q_nope [.., T, H, dn], q_pe [.., T, H, dr], c [.., T, r], k_pe [.., T, dr], w_uk [r, H, dn],
#        w_uv [r, H, dv]) -> (out [.., T, H, dv], aux)
MlaAttend = Callable[..., tuple[jax.Array, Any]]


# ------------------------------------------------------------------------------------- RoPE and scale


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(config: ModelConfig) -> float:
    rope = config.rope_scaling or {}
    factor = rope.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        return config.max_position_embeddings / rope["original_max_position_embeddings"]
    return float(factor)


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN's factor on cos and sin (so on q_pe and k_pe): transformers' `attention_factor`."""
    rope = config.rope_scaling
    if rope is None or rope["rope_type"] != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, all_dim = _yarn_factor(config), rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def softmax_scale(config: ModelConfig) -> float:
    """(dn + dr)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = config.qk_head_dim ** -0.5
    rope = config.rope_scaling
    if rope is not None and rope.get("mscale_all_dim"):
        m = yarn_mscale(_yarn_factor(config), rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def yarn_inv_freq(config: ModelConfig) -> np.ndarray:  # [dr // 2] float32
    """transformers' `_compute_yarn_parameters` inverse frequencies (float32 as torch computes them)."""
    f32, rope = np.float32, config.rope_scaling or {}
    dim, base = config.head_dim, config.rope_theta
    factor = _yarn_factor(config)
    original = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = f32(base) ** (np.arange(0, dim, 2).astype(f32) / f32(dim))
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation = f32(1) - ramp
    interpolation = f32(1) / (f32(factor) * pos_freqs)
    return (interpolation * (f32(1) - extrapolation) + (f32(1) / pos_freqs) * extrapolation).astype(f32)


def mla_rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:  # [..., T, H, dr]
    """RoPE of the rope part: YaRN frequencies and attention factor, interleaved pairs de-interleaved."""
    scaling = config.rope_scaling
    inv_freq = yarn_inv_freq(config) if scaling and scaling["rope_type"] == "yarn" else rope_inv_freq(config)
    if config.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    factor = rope_attention_factor(config)
    if factor == 1.0:
        return apply_rope(x, positions, inv_freq)
    # transformers scales cos and sin (float32) before the rotation
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]
    cos, sin = (jnp.cos(emb) * factor).astype(x.dtype), (jnp.sin(emb) * factor).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ------------------------------------------------------------------------------------------ attention


class MLAttention(nn.Module):
    """DeepSeek's attention projections; the attention itself is the caller's `attend`."""

    config: ModelConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        c, dt = self.config, self.param_dtype
        heads, q_dim = c.num_attention_heads, c.qk_head_dim
        if c.q_lora_rank:
            self.q_a_proj = _dense(c.q_lora_rank, c.attention_bias, dt, "q_a_proj")
            self.q_a_layernorm = RMSNorm(LATENT_NORM_EPS, dt)
            self.q_b_proj = _dense(heads * q_dim, False, dt, "q_b_proj")
        else:
            self.q_proj = _dense(heads * q_dim, False, dt, "q_proj")
        self.kv_a_proj_with_mqa = _dense(c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias, dt,
                                         "kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(LATENT_NORM_EPS, dt)
        self.kv_b_proj = Kernel((c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim)), dt)
        self.o_proj = _dense(c.hidden_size, c.attention_bias, dt, "o_proj")

    def __call__(self, x: jax.Array, positions: jax.Array, attend: MlaAttend) -> tuple[jax.Array, Any]:
        c = self.config
        lead, heads, dn = x.shape[:-1], c.num_attention_heads, c.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q = q.reshape(*lead, heads, c.qk_head_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :c.kv_lora_rank])
        q_pe = mla_rope(q[..., dn:], positions, c)
        k_pe = mla_rope(compressed[..., None, c.kv_lora_rank:], positions, c)[..., 0, :]
        w = self.kv_b_proj().reshape(c.kv_lora_rank, heads, dn + c.v_head_dim).astype(x.dtype)
        out, aux = attend(q[..., :dn], q_pe, latent, k_pe, w[..., :dn], w[..., dn:])
        return self.o_proj(out.reshape(*lead, heads * c.v_head_dim)), aux


def mla_attention_fn(config: ModelConfig, absorbed: AbsorbedFn = mla_absorbed_xla,
                     rebuilt: RebuiltFn = mla_prefill_rebuilt_xla,
                     rebuild_weight: float = 1.0) -> Callable[..., jax.Array]:
    """The paged op an MLA layer attends with: (q_nope, q_pe, latent_pages, w_uk, w_uv, md[, scale])
    -> [T, H, dv], decodes absorbed (by `absorbed`: `jaxcpp.kernels.backend.select_mla_absorbed`) and
    prefill chunks absorbed or rebuilt (by `rebuilt`: `select_mla_rebuilt`), whichever costs fewer FLOPs
    for the step, the rebuild's weighted by `rebuild_weight` (`--mla-prefill`; 1: plain FLOPs;
    `jaxcpp.kernels.mla_attention.mla_attention_auto`)."""
    shape = MlaShape(config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim,
                     config.qk_rope_head_dim, config.v_head_dim)
    flops = (shape.kv_b_flops, shape.pair_flops("absorbed"), shape.pair_flops("rebuilt"))
    return functools.partial(mla_attention_auto, sm_scale=softmax_scale(config), flops=flops, absorbed=absorbed,
                             rebuilt=rebuilt, rebuild_weight=rebuild_weight)


def paged_mla_attention(k_pages: jax.Array, layer: jax.Array, md: Any, attention_fn: Callable[..., jax.Array],
                        scale: jax.Array | None, q_nope: jax.Array, q_pe: jax.Array, latent: jax.Array,
                        k_pe: jax.Array, w_uk: jax.Array, w_uv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MLA over latent pages (`k_pages` [L, N, page_size, 1, r + dr], a stage's KVCache.k): write the
    step's (c, k_pe) rows into layer `layer`'s pages, then attend over all layers' pages viewed as one
    pool with this layer's page ids offset (as the K/V path does; a reshape is free, a slice would copy).
    fp8 pages: `scale`, one a layer for the whole row. Returns (out [T, H, dv], the updated k_pages)."""
    num_layers, num_pages, page_size = k_pages.shape[:3]
    pool = k_pages.reshape(num_layers * num_pages, page_size, k_pages.shape[-1])
    pool = write_latent_pages(pool, latent, k_pe, md.slot_mapping + layer * (num_pages * page_size), scale)
    layer_md = md._replace(page_indices=md.page_indices + layer * num_pages)
    return attention_fn(q_nope, q_pe, pool, w_uk, w_uv, layer_md, scale), pool.reshape(k_pages.shape)


def dense_mla_attention(q_nope: jax.Array, q_pe: jax.Array, latent: jax.Array, k_pe: jax.Array, w_uk: jax.Array,
                        w_uv: jax.Array, *, sm_scale: float) -> jax.Array:  # [B, T, H, dv]
    """Causal attention of whole sequences with the per-head K/V rebuilt (transformers' eager path)."""
    f32 = jnp.float32
    k_nope = jnp.einsum("btr,rhd->bthd", latent.astype(f32), w_uk.astype(f32))
    v = jnp.einsum("btr,rhd->bthd", latent.astype(f32), w_uv.astype(f32))
    scores = (jnp.einsum("bthd,bshd->bhts", q_nope.astype(f32), k_nope)
              + jnp.einsum("bthd,bsd->bhts", q_pe.astype(f32), k_pe.astype(f32))) * sm_scale
    t = q_nope.shape[1]
    probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v).astype(q_nope.dtype)


def dense_attend(config: ModelConfig) -> MlaAttend:
    fn = functools.partial(dense_mla_attention, sm_scale=softmax_scale(config))
    return lambda *args: (fn(*args), None)


# -------------------------------------------------------------------------------------------- the MoE


def route_deepseek(x: jax.Array, router_kernel: jax.Array, bias: jax.Array | None, config: ModelConfig
                   ) -> tuple[jax.Array, jax.Array]:  # (weights [N, k] float32, ids [N, k] int32)
    """DeepSeek's routers in float32. V3 (sigmoid): the correction bias shifts the choice only, groups
    ranked by the sum of their top 2 choice scores; V2 (softmax): groups ranked by their best score.
    The best `topk_group` groups stay, the top k experts of them are chosen, their (unbiased) scores
    renormalised when `norm_topk_prob`, then times `routed_scaling_factor`."""
    c = config
    logits = x.astype(jnp.float32) @ router_kernel.astype(jnp.float32)  # [N, E]
    sigmoid = c.router == "sigmoid"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if sigmoid and bias is not None else scores
    if c.topk_method == "group_limited":
        grouped = choice.reshape(choice.shape[0], c.n_group, -1)  # [N, G, E/G]
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1) if sigmoid else grouped.max(-1)
        _, keep = jax.lax.top_k(group_scores, c.topk_group)  # [N, topk_group]
        kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(keep.shape[0])[:, None], keep].set(True)
        masked = jnp.where(kept[:, :, None], grouped, -jnp.inf if sigmoid else 0.0)
        choice = masked.reshape(choice.shape)
    _, ids = jax.lax.top_k(choice, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids.astype(jnp.int32)


class DeepseekRouter(nn.Module):
    """The router's weight ("kernel" [D, E]) and V3's `e_score_correction_bias` [E] (float32, as
    transformers keeps it)."""

    num_experts: int
    with_bias: bool
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden_size: int) -> tuple[jax.Array, jax.Array | None]:
        kernel = self.param("kernel", nn.initializers.normal(0.02), (hidden_size, self.num_experts), self.param_dtype)
        bias = (self.param("e_score_correction_bias", nn.initializers.zeros, (self.num_experts,), jnp.float32)
                if self.with_bias else None)
        return kernel, bias


class DeepseekMoE(nn.Module):
    """Router ("gate": kernel [D, E], V3's correction bias) + routed experts + shared experts."""

    config: ModelConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, experts_fn: ExpertsFn = grouped_experts) -> jax.Array:  # [..., D]
        c = self.config
        flat = x.reshape(-1, x.shape[-1])
        router = DeepseekRouter(c.num_experts, c.router == "sigmoid", self.param_dtype, name="gate")
        kernel, bias = router(c.hidden_size)
        weights, ids = route_deepseek(flat, kernel, bias, c)
        out = experts_fn(flat, ids, weights, *Experts(c, self.param_dtype, name="experts")())
        out = out.astype(x.dtype).reshape(x.shape)
        if c.n_shared_experts:
            out = out + MLP(c, self.param_dtype, c.shared_expert_width, name="shared_experts")(x)
        return out
