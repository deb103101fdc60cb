"""The decoder every family shares (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), in flax.linen,
driven through a small functional API.

The math lives in linen modules (`RMSNorm`, `Attention`, `MLP`, `MoEBlock`, `DecoderLayer`; the pieces in
`layers` and `moe`); the functions below apply them to a plain params pytree whose decoder layers are
stacked along a leading `num_layers` axis:

    {"embed": [V, D], "layers": {<one DecoderLayer's params, each with a leading [L] axis>},
     "norm": [D], "lm_head": [D, V] (absent when the embeddings are tied)}

Where layers differ (an MoE model's dense layers, `ModelConfig.layer_runs`), "layers" is a list of runs
of alike layers, each such a stacked tree; a layer is an MoE layer when its "mlp" holds "experts".
A pipeline stage is a slice `layers[start:end]` (cut into its runs), run by `run_layers` under one
`jax.lax.scan` per run, so compile time does not grow with depth; or, as a CPU stage holds them
(`unstack_layers`), each run a list of per-layer trees run one after the other. The decoder layer takes attention as a
callable: the paged path writes the new K/V into the stage's `KVCache` and calls the ragged paged
attention op; `forward_dense` (training, tests) uses plain causal attention.
The model knows nothing of stages, sharding or scheduling.

8-bit storage: fp8 KV pages keep a K and a V scale per layer in the `KVCache` (writes quantize, the
attention op dequantizes on read); fp8 decoder weights are a `kernel` in float8_e4m3fn beside its
`kernel_scale` (one per output channel), turned back into the model dtype one layer at a time inside the
layer scan (`dequantize_weights`), since neither XLA:CPU nor the attention kernels have an fp8 dot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.kernels.metadata import AttentionFn, AttentionMetadata
from jaxcpp.kernels.ragged_paged_attention import (
    is_fp8,
    ragged_paged_attention_reference,
    write_kv_pages,
)
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.layers import INIT_STD, MLP, RMSNorm, _dense, apply_rope, rope_inv_freq
from jaxcpp.models.mla import DeepseekMoE, MLAttention, dense_attend, mla_attention_fn, paged_mla_attention
from jaxcpp.models.moe import ExpertsFn, MoEBlock, grouped_experts
from jaxcpp.models.runs import Layers, Run, is_moe_run, num_layers_of, run_length, runs_of

__all__ = ["INIT_STD", "MLP", "RMSNorm", "apply_rope", "rope_inv_freq"]  # re-exported: their old home

Params = dict[str, Any]
# attend(q [..., T, H, Dh], k [..., T, Hkv, Dh], v [..., T, Hkv, Dh]) -> (out [..., T, H, Dh], aux)
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]

class KVCache(NamedTuple):
    """Device state of one stage's pages."""

    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    # fp8 pages hold K / k_scale and V / v_scale (float pages: 1, unused). 0 means "not yet known": with
    # --calculate-kv-scales the first step with real tokens sets it (`_calculated_scales`).
    k_scale: jax.Array  # [num_layers] float32
    v_scale: jax.Array  # [num_layers] float32


KV_SCALE_HEADROOM = 2.0  # calculated scales map the first prefill's largest |K| to half the format's max


class Attention(nn.Module):
    """The projections around attention; the attention itself is the caller's (paged or dense)."""

    config: LlamaConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        c, dt = self.config, self.param_dtype
        self.q_proj = _dense(c.num_attention_heads * c.head_dim, c.attention_bias, dt, "q_proj")
        self.k_proj = _dense(c.num_key_value_heads * c.head_dim, c.attention_bias, dt, "k_proj")
        self.v_proj = _dense(c.num_key_value_heads * c.head_dim, c.attention_bias, dt, "v_proj")
        self.o_proj = _dense(c.hidden_size, c.attention_out_bias, dt, "o_proj")
        if c.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.rms_norm_eps, dt)

    def qkv(
        self,
        x: jax.Array,  # [..., T, D]
        positions: jax.Array,  # [T] or [..., T] int32
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [..., T, H, Dh], k/v [..., T, Hkv, Dh]
        c = self.config
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(c)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, attn: jax.Array) -> jax.Array:  # [..., T, H, Dh] -> [..., T, D]
        return self.o_proj(attn.reshape(*attn.shape[:-2], -1))

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend) -> tuple[jax.Array, Any]:
        attn, aux = attend(*self.qkv(x, positions))
        return self.out(attn), aux


def init_attend(*args: jax.Array) -> tuple[jax.Array, None]:
    """An `attend` for shapes only (param init): zeros of the output's shape, for either attention kind
    (its last argument is v [.., Hkv, Dh] or MLA's W_UV [r, H, dv])."""
    return jnp.zeros((*args[0].shape[:-1], args[-1].shape[-1]), args[0].dtype), None


class DecoderLayer(nn.Module):
    config: LlamaConfig
    param_dtype: Any = jnp.float32
    moe: bool = False  # the MoE block in place of the dense MLP

    def setup(self) -> None:
        c, dt = self.config, self.param_dtype
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dt)
        self.self_attn = MLAttention(c, dt) if c.is_mla else Attention(c, dt)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dt)
        moe_block = DeepseekMoE if c.is_mla else MoEBlock
        self.mlp = moe_block(c, dt) if self.moe else MLP(c, dt)

    def __call__(
        self,
        hidden: jax.Array,  # [..., T, D]
        positions: jax.Array,  # [T] or [..., T] int32
        attend: Attend,
        experts_fn: ExpertsFn = grouped_experts,
    ) -> tuple[jax.Array, Any]:  # ([..., T, D], whatever `attend` returned beside its output)
        attn, aux = self.self_attn(self.input_layernorm(hidden), positions, attend)
        hidden = hidden + attn
        normed = self.post_attention_layernorm(hidden)
        return hidden + (self.mlp(normed, experts_fn) if self.moe else self.mlp(normed)), aux


# ------------------------------------------------------------------------------------- functional API


def init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params (normal(0.02) weights, unit norms, zero biases) with layers stacked on axis 0
    (a list of such runs where dense and MoE layers mix)."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    d, v = config.hidden_size, config.vocab_size

    def init_run(moe: bool, keys: jax.Array) -> Params:
        layer = DecoderLayer(config, dtype, moe)

        def init_layer(k: jax.Array) -> Params:
            dummy = jnp.zeros((1, d), dtype)
            return layer.init(k, dummy, jnp.zeros((1,), jnp.int32), init_attend)["params"]

        return jax.vmap(init_layer)(keys)  # {...: [L, ...]}

    keys = jax.random.split(k_layers, config.num_hidden_layers)
    runs = [init_run(moe, keys[start:end]) for moe, start, end in config.layer_runs()]
    params: Params = {
        "embed": (jax.random.normal(k_embed, (v, d), jnp.float32) * INIT_STD).astype(dtype),  # [V, D]
        "layers": runs[0] if len(runs) == 1 else runs,
        "norm": jnp.ones((d,), dtype),  # [D]
    }
    if not config.tie_word_embeddings:
        lm_head = jax.random.normal(k_head, (d, v), jnp.float32) * INIT_STD
        params["lm_head"] = lm_head.astype(dtype)  # [D, V]
    return params


def embed(params: Params, token_ids: jax.Array) -> jax.Array:  # [...] int32 -> [..., D]
    return jnp.take(params["embed"], token_ids, axis=0)


def dequantize_weights(layer_params: Params, dtype: Any) -> Params:
    """fp8 kernels ({"kernel": [in, out] fp8, "kernel_scale": [out]}) -> plain `dtype` kernels; other
    leaves as they are. Called on one layer's params inside the scan, so only one layer is ever wide."""
    if not isinstance(layer_params, dict):
        return layer_params
    if "kernel_scale" not in layer_params:
        return {name: dequantize_weights(sub, dtype) for name, sub in layer_params.items()}
    out = {name: x for name, x in layer_params.items() if name != "kernel_scale"}
    scale = layer_params["kernel_scale"].astype(jnp.float32)[..., None, :]  # per output channel
    out["kernel"] = (layer_params["kernel"].astype(jnp.float32) * scale).astype(dtype)
    return out


def _calculated_scales(kv: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, md: AttentionMetadata
                       ) -> KVCache:
    """--calculate-kv-scales: a layer scale still 0 becomes the step's largest |K| (|V|) over its real
    tokens divided by half the format's max, once the step has a real token; known scales stay."""
    num_tokens = k.shape[0]
    real = (jnp.arange(num_tokens) < md.cu_q_lens[md.num_seqs])[:, None, None]  # [T, 1, 1]
    limit = float(jnp.finfo(kv.k.dtype).max) / KV_SCALE_HEADROOM

    def update(scales: jax.Array, x: jax.Array) -> jax.Array:
        amax = jnp.max(jnp.where(real, jnp.abs(x.astype(jnp.float32)), 0.0))
        new = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / limit
        known = scales[layer] > 0
        return scales.at[layer].set(jnp.where(known | ~jnp.any(real), scales[layer], new))

    return kv._replace(k_scale=update(kv.k_scale, k), v_scale=update(kv.v_scale, v))


def _layer_scales(kv: KVCache, layer: jax.Array) -> jax.Array:  # [2] float32
    """The layer's K and V scale; a scale still 0 (no real token seen yet) divides as 1, so a padding
    write into page 0 stays finite."""
    scales = jnp.stack([kv.k_scale[layer], kv.v_scale[layer]])
    return jnp.where(scales > 0, scales, 1.0)


def _write_layer_kv(
    kv: KVCache,
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32, slots within one layer's pages
    kv_scales: jax.Array | None = None,  # [2] float32: fp8 pages' scales of this layer
) -> KVCache:
    """Scatter layer `layer`'s new K/V straight into the stacked cache (viewing [L, N, ...] as [L*N, ...]).

    Writing the whole carry in place costs O(T); slicing out the layer, writing and `.at[layer].set`
    would make XLA copy the layer's page pool twice per layer per step.
    """
    num_layers, num_pages, page_size = kv.k.shape[:3]
    flat = (num_layers * num_pages, *kv.k.shape[2:])
    slots = slot_mapping + layer * (num_pages * page_size)
    k_all, v_all = write_kv_pages(kv.k.reshape(flat), kv.v.reshape(flat), k, v, slots, kv_scales)
    return kv._replace(k=k_all.reshape(kv.k.shape), v=v_all.reshape(kv.v.shape))


def run_layers(
    layer_params: Layers,  # {...: [L, ...]} (or runs of them, each maybe per layer): all layers or a stage's
    hidden: jax.Array,  # [T, D]
    kv: KVCache,  # pages of exactly these L layers
    md: AttentionMetadata,
    config: LlamaConfig,
    attention_fn: AttentionFn | None = None,
    *,
    calculate_kv_scales: bool = False,
    experts_fn: ExpertsFn = grouped_experts,
) -> tuple[jax.Array, KVCache]:  # ([T, D], kv with this step's K/V written)
    """Run decoder layers on a ragged token batch, writing each layer's new K/V in place; one scan per
    stacked run of alike layers (a per-layer run, `unstack_layers`: its layers one after the other), the
    runs' layers numbered on through the one KV cache.
    fp8 pages: writes quantize with the layer's scales, which the attention op gets to dequantize;
    `calculate_kv_scales`: scales still 0 are set from this step's K/V first (`_calculated_scales`);
    `experts_fn`: the MoE layers' experts (expert-parallel under a mesh: `sharding.shard_experts`)."""
    attention_fn = attention_fn or default_attention(config)
    num_layers = num_layers_of(layer_params)
    if kv.k.shape[0] != num_layers:
        raise ValueError(f"KV cache holds {kv.k.shape[0]} layers but layer_params has {num_layers}")
    first = 0
    for run in runs_of(layer_params):
        n = run_length(run)
        hidden, kv = _run_alike(run, first, hidden, kv, md, config, attention_fn, calculate_kv_scales, experts_fn)
        first += n
    return hidden, kv


def _run_alike(run: Run, first: int, hidden: jax.Array, kv: KVCache, md: AttentionMetadata, config: LlamaConfig,
               attention_fn: AttentionFn, calculate_kv_scales: bool, experts_fn: ExpertsFn
               ) -> tuple[jax.Array, KVCache]:
    """One run of alike layers, under `lax.scan` when stacked, else layer by layer (the same body, so the
    same math in the same order); its layers are the cache's first, first + 1, ..."""
    layer = DecoderLayer(config, moe=is_moe_run(run))
    fp8 = is_fp8(kv.k.dtype)

    def body(carry: tuple[jax.Array, KVCache], xs: tuple[Params, jax.Array]) -> tuple[Any, None]:
        hidden, kv = carry
        lp, i = xs

        def attend_latent(*args: jax.Array) -> tuple[jax.Array, Any]:  # MLA: latent rows in kv.k
            scaled_kv = kv
            if fp8 and calculate_kv_scales:
                row = jnp.concatenate([args[2], args[3].astype(args[2].dtype)], axis=-1)[:, None, :]
                scaled_kv = _calculated_scales(kv, i, row, row, md)
            scale = _layer_scales(scaled_kv, i)[0] if fp8 else None
            out, k = paged_mla_attention(scaled_kv.k, i, md, attention_fn, scale, *args)
            return out, scaled_kv._replace(k=k)

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
            scaled_kv = _calculated_scales(kv, i, k, v, md) if fp8 and calculate_kv_scales else kv
            scales = _layer_scales(scaled_kv, i) if fp8 else None
            new_kv = _write_layer_kv(scaled_kv, i, k, v, md.slot_mapping, scales)
            # Attend over all layers' pages viewed as one pool, with this layer's page ids offset:
            # a reshape is free, while slicing out layer i would copy its whole page pool every step.
            num_layers, num_pages = kv.k.shape[:2]
            pool = (num_layers * num_pages, *kv.k.shape[2:])
            layer_md = md._replace(page_indices=md.page_indices + i * num_pages)
            pages = (q, new_kv.k.reshape(pool), new_kv.v.reshape(pool), layer_md)
            return attention_fn(*pages, scales) if fp8 else attention_fn(*pages), new_kv

        lp = dequantize_weights(lp, hidden.dtype)
        out: Any = layer.apply({"params": lp}, hidden, md.positions, attend_latent if config.is_mla else attend,
                               experts_fn)  # (hidden, kv)
        return out, None

    if isinstance(run, list):
        carry = (hidden, kv)
        for i, lp in enumerate(run):
            carry, _ = body(carry, (lp, jnp.int32(first + i)))
        return carry
    indices = jnp.arange(first, first + run_length(run))
    (hidden, kv), _ = jax.lax.scan(body, (hidden, kv), (run, indices))
    return hidden, kv


def default_attention(config: LlamaConfig) -> AttentionFn:
    """The paged attention op a model's layers take when the caller names none: the ragged reference,
    or for an MLA model the latent-page op with the per-step choice of form by FLOPs (`mla_attention_fn`;
    a stage's op follows its flags: `runtime/stage_ops.model_attention`)."""
    return mla_attention_fn(config) if config.is_mla else ragged_paged_attention_reference


def compute_logits(
    params: Params,  # needs "norm" and "lm_head" (or "embed" when tied)
    hidden: jax.Array,  # [..., D]
    config: LlamaConfig,
) -> jax.Array:  # [..., V] float32
    """Final RMSNorm, then the LM head (the embedding matrix, transposed, when tied)."""
    normed: Any = RMSNorm(config.rms_norm_eps).apply({"params": {"scale": params["norm"]}}, hidden)
    if "lm_head" in params:
        logits = normed @ params["lm_head"].astype(normed.dtype)
    else:
        logits = normed @ params["embed"].astype(normed.dtype).T
    return logits.astype(jnp.float32)


def forward(
    params: Params,
    token_ids: jax.Array,  # [T] int32
    kv: KVCache,
    md: AttentionMetadata,
    config: LlamaConfig,
    attention_fn: AttentionFn | None = None,
) -> tuple[jax.Array, KVCache]:  # (hidden [T, D] before the final norm, kv)
    return run_layers(params["layers"], embed(params, token_ids), kv, md, config, attention_fn)


def dense_causal_attention(
    q: jax.Array,  # [B, T, H, Dh]
    k: jax.Array,  # [B, T, Hkv, Dh]
    v: jax.Array,  # [B, T, Hkv, Dh]
) -> jax.Array:  # [B, T, H, Dh]
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, hkv, h // hkv, dh) * dh**-0.5
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))  # [B, Hkv, G, T, T]
    causal = jnp.tril(jnp.ones((t, t), bool))
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(b, t, h, dh).astype(q.dtype)


def forward_dense(
    params: Params,
    token_ids: jax.Array,  # [B, T] int32
    config: LlamaConfig,
) -> jax.Array:  # [B, T, V] float32
    """Whole sequences from position 0 with plain causal attention: training and tests."""
    positions = jnp.arange(token_ids.shape[-1], dtype=jnp.int32)
    hidden = embed(params, token_ids)
    attend = dense_attend(config) if config.is_mla else lambda q, k, v: (dense_causal_attention(q, k, v), None)
    for run in runs_of(params["layers"]):
        layer = DecoderLayer(config, moe=is_moe_run(run))

        def body(hidden: jax.Array, lp: Params, layer: DecoderLayer = layer) -> tuple[jax.Array, None]:
            lp = dequantize_weights(lp, hidden.dtype)
            hidden, _ = layer.apply({"params": lp}, hidden, positions, attend)
            return hidden, None

        hidden, _ = jax.lax.scan(body, hidden, run)
    return compute_logits(params, hidden, config)


def make_kv_cache(
    config: LlamaConfig, num_layers: int, num_pages: int, page_size: int, dtype: Any = jnp.float32,
    k_scale: Any = None,  # [num_layers] float32 (default 1; 0: calculate from the first prefill)
    v_scale: Any = None,  # [num_layers] float32
) -> KVCache:
    shape = (num_layers, num_pages, page_size, config.num_key_value_heads, config.head_dim)
    v_shape = shape
    if config.is_mla:  # one latent row a token a layer in k ("one KV head"), nothing in v
        shape, v_shape = (*shape[:3], 1, config.kv_lora_rank + config.qk_rope_head_dim), (*shape[:3], 1, 0)
    ones = jnp.ones((num_layers,), jnp.float32)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(v_shape, dtype),
                   ones if k_scale is None else jnp.asarray(k_scale, jnp.float32),
                   ones if v_scale is None else jnp.asarray(v_scale, jnp.float32))


def param_count(params: Params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
