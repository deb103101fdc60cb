"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a paged LATENT cache.

The cache. A page holds, per token and layer, one row of `kv_lora_rank + qk_rope_head_dim` values: the
normalized kv latent c (kv_a_layernorm's output, `kv_lora_rank` wide) followed by the roped key part
k_rope (`qk_rope_head_dim`), one shared "head": `latent_pages [num_pages, page_size, r + dr]`. Nothing is
stored per attention head; a head's key is [c @ W_UK_h, k_rope] and its value c @ W_UV_h, where
`kv_b_proj` (transformers' `[H * (dn + dv), r]` weight) holds W_UK and W_UV (`split_kv_b`).

Two ways to attend, the same math (tested equal to float32 rounding):

- absorbed (`mla_absorbed_*`): the queries move into the latent space instead, q_latent_h = q_nope_h @
  W_UK_h^T (`absorb_queries`), so score = q_latent . c + q_rope . k_rope and the output, probs @ c, is in
  the latent space ([T, H, r]); the caller projects it back with W_UV (`project_values`). Per (query,
  key) pair a head costs 2·(2r + dr) FLOPs, and nothing is rebuilt: decodes always take this form.
  It is multi-query attention with K = the whole latent row and V = its first r values, so the XLA
  path and the reference are the ragged paged attention ops on that one-KV-head view (V read as the
  whole row and cut to r: 64 of 576 values of the second product wasted, no second code path to keep
  exact). The Pallas kernel reads c and k_rope as two tiles of the one page array.
- rebuilt (`mla_prefill_rebuilt_xla`): for each prefill sequence of the batch the per-head K and V of its
  whole context (cached prefix + chunk) are rebuilt from the latent ONCE (`kv_b_proj`: 2·r·H·(dn + dv)
  FLOPs a token), then its queries attend causally with head dims dn + dr for q/k and dv for v, 2·H·(dn
  + dr + dv) FLOPs a pair. The rebuild is the γ·L term of the latency model; it pays off once a chunk
  is long enough that the cheaper pairs outweigh it (`jaxcpp.chunking.mla_cost`). Its Pallas twin
  (`kernels/mla_rebuilt.py: mla_prefill_rebuilt_attention`) keeps the rebuild an XLA GEMM, once per KV
  block, and folds each rebuilt block into the online softmax with a Pallas kernel (q/k head dim dn +
  dr, v head dim dv: what the ragged kernel cannot serve).

`mla_attention_xla` joins them for a step: decodes absorbed, prefill chunks absorbed or rebuilt as the
caller chooses, each form by the op it is given (XLA or Pallas: `kernels/backend.py`). FP8 pages
(`--kv-cache-dtype fp8*`): one scale per layer for the whole latent row; writes quantize (`quantize_kv`),
reads dequantize (folded into the score and output multipliers in the absorbed form, into the rebuild
in the rebuilt one).

The Pallas kernel here (absorbed form, GPU/ROCm through Triton, anywhere with `interpret=True`) is the ragged
paged attention kernel's algorithm (see that file and docs/kernels.md) with one KV head: grid = (query
blocks of `block_q` tokens, head blocks of `block_h` heads), a program owns `block_q * block_h` rows
(token-major) and walks the sequences its block touches, their KV blocks of `pages_per_block` pages,
with an fp32 online softmax; c and k_rope are two BlockSpecs over the same page array (so r must be a
multiple of dr, as in every released MLA model: 512 / 64).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.ragged_paged_attention import (
    MASK_VALUE,
    _block_seq_ranges,
    _is_pow2,
    _online_softmax_step,
    _pad_pages,
    check_inputs,
    quantize_kv,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)

Array = jax.Array
# (q_latent [T, H, r], q_rope [T, H, dr], latent_pages, md, latent_scale, *, sm_scale) -> [T, H, r]:
# `mla_absorbed_xla`, or the Pallas kernel (`mla_absorbed_attention`; kernels.backend.select_mla_absorbed)
AbsorbedFn = Callable[..., Array]
# (q_nope [T, H, dn], q_rope, latent_pages, w_uk, w_uv, md, latent_scale, *, sm_scale) -> [T, H, dv]:
# `mla_prefill_rebuilt_xla`, or its Pallas twin (`kernels/mla_rebuilt.py`; kernels.backend.select_mla_rebuilt)
RebuiltFn = Callable[..., Array]
DEFAULT_REBUILD_BLOCK_Q = 64  # query tokens per block of the rebuilt form
DEFAULT_REBUILD_KV_BLOCK_TOKENS = 128  # KV positions rebuilt / visited per inner step


# ------------------------------------------------------------------------------ cache and projections


def write_latent_pages(
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    c_kv: jax.Array,  # [T, r]: kv_a_layernorm(kv_a_proj_with_mqa(x)[:, :r])
    k_rope: jax.Array,  # [T, dr]: the roped shared key part
    slot_mapping: jax.Array,  # [T] int32
    latent_scale: jax.Array | None = None,  # [] float32: the layer's scale of fp8 pages
) -> jax.Array:
    """Scatter the step's new latent rows into their slots (padding tokens land in the unused page 0)."""
    num_pages, page_size, width = latent_pages.shape
    if c_kv.shape[-1] + k_rope.shape[-1] != width:
        raise ValueError(f"c_kv.shape={c_kv.shape} and k_rope.shape={k_rope.shape} do not fill a latent row "
                         f"of latent_pages.shape={latent_pages.shape}")
    row = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)
    if latent_scale is not None:
        row = quantize_kv(row, latent_scale, latent_pages.dtype)
    flat = latent_pages.reshape(num_pages * page_size, width).at[slot_mapping].set(row.astype(latent_pages.dtype))
    return flat.reshape(latent_pages.shape)


def split_kv_b(kv_b_weight: jax.Array, num_heads: int, qk_nope_head_dim: int,
               v_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """transformers' kv_b_proj weight [H * (dn + dv), r] -> W_UK [r, H, dn], W_UV [r, H, dv]."""
    rank = kv_b_weight.shape[1]
    per_head = kv_b_weight.T.reshape(rank, num_heads, qk_nope_head_dim + v_head_dim)
    return per_head[..., :qk_nope_head_dim], per_head[..., qk_nope_head_dim:]


def absorb_queries(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """q_nope [T, H, dn] -> q_latent [T, H, r]: q_latent_h . c = q_nope_h . (c @ W_UK_h), for every c."""
    return jnp.einsum("thd,rhd->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)


def project_values(out_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """The absorbed form's latent output [T, H, r] -> [T, H, dv]:
    sum_n p_n (c_n @ W_UV_h) = (sum_n p_n c_n) @ W_UV_h."""
    return jnp.einsum("thr,rhd->thd", out_latent, w_uv, preferred_element_type=jnp.float32).astype(out_latent.dtype)


# ------------------------------------------------------------------------------------ absorbed form


def _mqa_view(q_latent: Array, q_rope: Array, latent_pages: Array,
              latent_scale: Array | None) -> tuple[Array, Array, Array | None]:
    """The absorbed form as one-KV-head attention: q = [q_latent, q_rope], K = V = the latent row."""
    check_latent_inputs(q_latent, q_rope, latent_pages)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    scales = None if latent_scale is None else jnp.full((2,), latent_scale, jnp.float32)
    return q, latent_pages[:, :, None, :], scales


def mla_absorbed_reference(
    q_latent: jax.Array,  # [T, H, r]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,  # DeepSeek: qk_head_dim ** -0.5, times mscale² under YaRN
) -> jax.Array:  # [T, H, r]
    """The correctness yardstick: every token gathers its own pages (the ragged reference, one KV head)."""
    q, pages, scales = _mqa_view(q_latent, q_rope, latent_pages, latent_scale)
    out = ragged_paged_attention_reference(q, pages, pages, md, scales, sm_scale=sm_scale)
    return out[..., :q_latent.shape[-1]]


def mla_absorbed_xla(
    q_latent: jax.Array,  # [T, H, r]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
) -> jax.Array:  # [T, H, r]
    """The CPU path of the absorbed form: the ragged XLA path (decodes grouped, prefill per query block)."""
    q, pages, scales = _mqa_view(q_latent, q_rope, latent_pages, latent_scale)
    out = ragged_paged_attention_xla(q, pages, pages, md, scales, sm_scale=sm_scale)
    return out[..., :q_latent.shape[-1]]


# ------------------------------------------------------------------------------------- rebuilt form


def _rebuild_block(latent_pages: Array, pages: Array, w_uk: Array, w_uv: Array,
                   scale: Array) -> tuple[Array, Array, Array]:
    """The latent rows in `pages`, rebuilt (fp32): per-head k_nope [n, H, dn], the shared k_rope [n, dr]
    (one for all heads, as stored) and per-head V [n, H, dv]. The kv_b_proj GEMM: 2·r·H·(dn + dv) a row."""
    rank = w_uk.shape[0]
    rows = latent_pages[pages].reshape(-1, latent_pages.shape[-1]).astype(jnp.float32) * scale
    c = rows[:, :rank]
    return jnp.einsum("nr,rhd->nhd", c, w_uk), rows[:, rank:], jnp.einsum("nr,rhd->nhd", c, w_uv)


def _rebuilt_sequence(q: Array, latent_pages: Array, pages_of_seq: Array, w_uk: Array, w_uv: Array, scale: Array,
                      out: Array, q_start: Array, q_end: Array, kv_len: Array, *, block_q: int,
                      block_pages: int) -> Array:
    """One prefill sequence in the rebuilt form: KV block by KV block, each block's per-head K/V rebuilt
    ONCE from its latent rows, then folded into the online softmax of every query block of the chunk
    that sees any of it (the causal skip: a chunk of x after L costs about x·L + x²/2 pairs, and W·(L +
    x) for the rebuild). No buffer grows with the context. q: [T + block_q, H, dq] fp32, scaled; rows
    outside [q_start, q_end) keep `out`'s values."""
    num_heads, dv = w_uv.shape[1:]
    block_tokens = block_pages * latent_pages.shape[1]
    first_pos = kv_len - (q_end - q_start)  # position of the chunk's first token
    num_q_blocks = (q_end - q_start + block_q - 1) // block_q
    offsets = jnp.arange(block_q, dtype=jnp.int32)
    kv_offsets = jnp.arange(block_tokens, dtype=jnp.int32)
    padded = q.shape[0]
    state = (jnp.full((padded, num_heads), MASK_VALUE, jnp.float32), jnp.zeros((padded, num_heads), jnp.float32),
             jnp.zeros((padded, num_heads, dv), jnp.float32))

    def kv_block(i: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        k_nope, k_rope, v = _rebuild_block(
            latent_pages, lax.dynamic_slice_in_dim(pages_of_seq, i * block_pages, block_pages), w_uk, w_uv, scale)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None, :], (*k_nope.shape[:2], k_rope.shape[-1]))],
                            axis=-1)
        # Query blocks before the one holding position i·block_tokens see none of this block.
        first_block = jnp.maximum(i * block_tokens - first_pos, 0) // block_q

        def query_block(j: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            t0 = q_start + j * block_q
            take = lambda x: lax.dynamic_slice_in_dim(x, t0, block_q)  # noqa: E731
            visible = jnp.where(t0 + offsets < q_end, first_pos + j * block_q + offsets + 1, 0)
            scores = jnp.einsum("qhd,nhd->qhn", take(q), k)
            mask = (i * block_tokens + kv_offsets < visible[:, None])[:, None, :]
            m, denom, acc = _online_softmax_step(take(state[0]), take(state[1]), take(state[2]), scores, mask, v,
                                                 "qhn,nhd->qhd")
            return tuple(lax.dynamic_update_slice_in_dim(x, part, t0, axis=0)  # type: ignore[return-value]
                         for x, part in zip(state, (m, denom, acc), strict=True))

        return lax.fori_loop(first_block, num_q_blocks, query_block, state)

    _, denom, acc = lax.fori_loop(0, (kv_len + block_tokens - 1) // block_tokens, kv_block, state)
    new = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    rows = jnp.arange(padded, dtype=jnp.int32)
    member = ((rows >= q_start) & (rows < q_end))[:, None, None]
    return jnp.where(member, new, out)


def mla_prefill_rebuilt_xla(
    q_nope: jax.Array,  # [T, H, dn]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    w_uk: jax.Array,  # [r, H, dn]
    w_uv: jax.Array,  # [r, H, dv]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    block_q: int = DEFAULT_REBUILD_BLOCK_Q,
    kv_block_tokens: int = DEFAULT_REBUILD_KV_BLOCK_TOKENS,
) -> jax.Array:  # [T, H, dv]; decode and padding tokens 0
    """Prefill tokens by rebuilding: each prefill sequence's per-head K/V rebuilt once from its latent
    rows (the cached prefix and the chunk, written to the pages before this call), then ordinary causal
    attention with the value head dim dv. The sequences are visited in turn (a loop with data bounds:
    a new mix compiles nothing)."""
    check_latent_inputs(q_nope, q_rope, latent_pages, w_uk=w_uk, w_uv=w_uv)
    _check_metadata(q_nope, latent_pages, md)
    num_tokens, num_heads, _ = q_nope.shape
    block_pages = max(1, kv_block_tokens // latent_pages.shape[1])
    block_q = max(1, min(block_q, num_tokens))
    pages_of = _pad_pages(md.page_indices, block_pages)
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1).astype(jnp.float32) * sm_scale
    q = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    scale = jnp.float32(1.0) if latent_scale is None else latent_scale.astype(jnp.float32)
    w_uk, w_uv = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)

    def one_sequence(s: Array, out: Array) -> Array:
        return _rebuilt_sequence(q, latent_pages, pages_of[s], w_uk, w_uv, scale, out, md.cu_q_lens[s],
                                 md.cu_q_lens[s + 1], md.kv_lens[s], block_q=block_q, block_pages=block_pages)

    out = jnp.zeros((num_tokens + block_q, num_heads, w_uv.shape[-1]), jnp.float32)
    out = lax.fori_loop(md.num_decodes, md.num_seqs, one_sequence, out)
    return out[:num_tokens].astype(q_nope.dtype)


def mla_attention_xla(
    q_nope: jax.Array,  # [T, H, dn]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    w_uk: jax.Array,  # [r, H, dn]
    w_uv: jax.Array,  # [r, H, dv]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    rebuild_prefill: bool,
    absorbed: AbsorbedFn = mla_absorbed_xla,
    rebuilt: RebuiltFn = mla_prefill_rebuilt_xla,
) -> jax.Array:  # [T, H, dv]
    """One step's MLA: decodes absorbed (`absorbed`: the XLA path or the Pallas kernel); prefill chunks
    absorbed, or rebuilt when `rebuild_prefill` (the host's choice, `jaxcpp.chunking.mla_cost.prefer_rebuild`,
    made per step) by `rebuilt` (the XLA path or the Pallas one)."""
    absorbed_md = md._replace(num_seqs=md.num_decodes) if rebuild_prefill else md  # the rest: padding, 0
    latent = absorbed(absorb_queries(q_nope, w_uk), q_rope, latent_pages, absorbed_md, latent_scale,
                      sm_scale=sm_scale)
    out = project_values(latent, w_uv)
    if rebuild_prefill:
        out = out + rebuilt(q_nope, q_rope, latent_pages, w_uk, w_uv, md, latent_scale, sm_scale=sm_scale)
    return out


def rebuild_is_cheaper(md: AttentionMetadata, kv_b_flops: float, absorbed_pair_flops: float,
                       rebuilt_pair_flops: float, rebuild_weight: float = 1.0) -> jax.Array:  # [] bool
    """`jaxcpp.chunking.mla_cost.prefer_rebuild` for a whole step, on the device: rebuilding the
    prefill chunks' contexts (W per context token, the rebuilt pair cost), weighted by `rebuild_weight`
    (1: FLOPs; the device's measured one: `jaxcpp.runtime.mla_prefill`; inf never, 0 always), costs
    less in sum than attending them absorbed (W per new token, the absorbed pair cost). Data, not
    shape: no compile; the weight is fixed at start-up, a constant of the program."""
    seqs = jnp.arange(md.kv_lens.shape[0])
    prefill = (seqs >= md.num_decodes) & (seqs < md.num_seqs)
    new = (md.cu_q_lens[1:] - md.cu_q_lens[:-1]).astype(jnp.float32)
    cached = md.kv_lens.astype(jnp.float32) - new
    pairs = cached * new + new * (new + 1) / 2
    rebuilt = kv_b_flops * (cached + new) + rebuilt_pair_flops * pairs
    absorbed = kv_b_flops * new + absorbed_pair_flops * pairs
    rebuilt_sum = jnp.sum(jnp.where(prefill, rebuilt, 0.0))
    weighted = jnp.where(rebuilt_sum > 0, rebuild_weight * rebuilt_sum, jnp.inf)  # no prefill: absorbed (inf*0)
    return weighted < jnp.sum(jnp.where(prefill, absorbed, 0.0))


def mla_attention_auto(
    q_nope: jax.Array,  # [T, H, dn]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    w_uk: jax.Array,  # [r, H, dn]
    w_uv: jax.Array,  # [r, H, dv]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    flops: tuple[float, float, float],  # (W, absorbed pair, rebuilt pair): jaxcpp.chunking.mla_cost.MlaShape's
    absorbed: AbsorbedFn = mla_absorbed_xla,
    rebuilt: RebuiltFn = mla_prefill_rebuilt_xla,
    rebuild_weight: float = 1.0,
) -> jax.Array:  # [T, H, dv]
    """A step's MLA with the form of its prefill chunks chosen per step by weighted FLOPs
    (`rebuild_is_cheaper`): both forms are compiled into the one program, a `lax.cond` runs one; a
    weight of inf or 0 (`--mla-prefill absorbed` / `rebuilt`) compiles that form alone."""
    if rebuild_weight in (0.0, math.inf):
        return mla_attention_xla(q_nope, q_rope, latent_pages, w_uk, w_uv, md, latent_scale, sm_scale=sm_scale,
                                 rebuild_prefill=rebuild_weight == 0.0, absorbed=absorbed, rebuilt=rebuilt)

    def run(rebuild: bool) -> Any:
        return lambda: mla_attention_xla(q_nope, q_rope, latent_pages, w_uk, w_uv, md, latent_scale,
                                         sm_scale=sm_scale, rebuild_prefill=rebuild, absorbed=absorbed,
                                         rebuilt=rebuilt)

    return lax.cond(rebuild_is_cheaper(md, *flops, rebuild_weight), run(True), run(False))


# ----------------------------------------------------------------------------------------------- kernel


def _kernel(
    first_seq_ref: Any,  # [num_q_blocks] int32: first sequence touching each query block
    last_seq_ref: Any,  # [num_q_blocks] int32: last one (first > last: padding block)
    cu_q_lens_ref: Any,  # [S + 1] int32
    kv_lens_ref: Any,  # [S] int32
    page_indices_ref: Any,  # [S, P'] int32, P' a multiple of pages_per_block
    scale_ref: Any,  # [1] float32: the latent scale (1 for pages stored as they are)
    q_lat_ref: Any,  # [block_q, block_h, r]
    q_rope_ref: Any,  # [block_q, block_h, dr]
    c_pages_ref: Any,  # [num_pages, page_size, r]: the latent part of every page
    rope_pages_ref: Any,  # [num_pages, page_size, dr]: the rope part (same array, another block)
    o_ref: Any,  # [block_q, block_h, r]
    *,
    sm_scale: float,
    pages_per_block: int,
) -> None:
    block_q, block_h, rank = q_lat_ref.shape
    rope_dim = q_rope_ref.shape[-1]
    page_size = c_pages_ref.shape[1]
    rows, block_kv = block_q * block_h, pages_per_block * page_size
    q_block = pl.program_id(0)
    t0 = q_block * block_q
    q_lat = q_lat_ref[...].reshape(rows, rank)
    q_rope = q_rope_ref[...].reshape(rows, rope_dim)
    scale = scale_ref[0]
    row_token = t0 + jnp.arange(rows, dtype=jnp.int32)[:, None] // block_h  # [rows, 1]
    kv_offsets = jnp.arange(block_kv, dtype=jnp.int32)[None, :]
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32)

    def visit_sequence(s: Array, carry: Any) -> Any:
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        first_pos = kv_len - (q_end - q_start)
        lo, hi = jnp.maximum(q_start, t0), jnp.minimum(q_end, t0 + block_q)
        kv_end = jnp.where(hi > lo, first_pos + hi - q_start, 0)
        in_seq = (row_token >= lo) & (row_token < hi)
        visible = jnp.where(in_seq, first_pos + row_token - q_start + 1, 0)  # [rows, 1]

        def visit_kv_block(j: Array, carry: Any) -> Any:
            m, denom, acc = carry
            pages = page_indices_ref[s, pl.ds(j * pages_per_block, pages_per_block)]
            c = c_pages_ref[pages].reshape(block_kv, rank).astype(q_lat.dtype)
            k_rope = rope_pages_ref[pages].reshape(block_kv, rope_dim).astype(q_rope.dtype)
            contract = (((1,), (1,)), ((), ()))
            scores = (dot(q_lat, c, contract) + dot(q_rope, k_rope, contract)) * (sm_scale * scale)
            mask = j * block_kv + kv_offsets < visible
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(axis=1))
            correction = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(scores - m_new[:, None]), 0.0)
            denom = denom * correction + p.sum(axis=1)
            pv = dot(p.astype(c.dtype), c, (((1,), (0,)), ((), ())))
            return m_new, denom, acc * correction[:, None] + pv

        return lax.fori_loop(0, pl.cdiv(kv_end, block_kv), visit_kv_block, carry)

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, rank), jnp.float32))
    _, denom, acc = lax.fori_loop(first_seq_ref[q_block], last_seq_ref[q_block] + 1, visit_sequence, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None] * scale
    o_ref[...] = out.reshape(block_q, block_h, rank).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------- wrapper


def check_latent_inputs(q_a: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, *,
                        w_uk: jax.Array | None = None, w_uv: jax.Array | None = None) -> None:
    """Raise ValueError naming the shapes when the inputs break the latent layout.

    q_a is q_latent [T, H, r] (absorbed) or q_nope [T, H, dn] (rebuilt, with w_uk [r, H, dn] and w_uv
    [r, H, dv]); latent pages are [num_pages, page_size, r + dr]."""
    if q_a.ndim != 3 or q_rope.ndim != 3 or q_a.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"queries must be [T, H, d] with the same T and H, got {q_a.shape} and "
                         f"q_rope.shape={q_rope.shape}")
    if latent_pages.ndim != 3:
        raise ValueError(f"latent_pages must be [num_pages, page_size, kv_lora_rank + qk_rope_head_dim], "
                         f"got latent_pages.shape={latent_pages.shape}")
    rope_dim, width = q_rope.shape[-1], latent_pages.shape[-1]
    rank = w_uk.shape[0] if w_uk is not None else q_a.shape[-1]
    if rank + rope_dim != width:
        raise ValueError(f"latent_pages.shape={latent_pages.shape}: a row must hold kv_lora_rank ({rank}) + "
                         f"qk_rope_head_dim ({rope_dim}) = {rank + rope_dim} values")
    if w_uk is not None and w_uv is not None and (
            w_uk.shape != (rank, q_a.shape[1], q_a.shape[2]) or w_uv.shape[:2] != (rank, q_a.shape[1])):
        raise ValueError(f"w_uk must be [r, H, dn] = {[rank, *q_a.shape[1:]]} and w_uv [r, H, dv], got "
                         f"w_uk.shape={w_uk.shape}, w_uv.shape={w_uv.shape}")


def _check_metadata(q: jax.Array, latent_pages: jax.Array, md: AttentionMetadata) -> None:
    """The ragged metadata contract (shapes against q's T), checked as for one KV head of q's width."""
    pages = jax.ShapeDtypeStruct((*latent_pages.shape[:2], 1, q.shape[-1]), latent_pages.dtype)
    check_inputs(q, pages, pages, md)  # only shapes are read


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_q", "block_h", "pages_per_block", "num_warps", "num_stages", "interpret"),
)
def mla_absorbed_attention(
    q_latent: jax.Array,  # [T, H, r]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    block_q: int | None = None,  # query tokens per program; default: enough for 16 rows (Triton's smallest dot)
    block_h: int | None = None,  # query heads per program; default all (up to 64)
    pages_per_block: int | None = None,  # KV pages per inner step; default 64 tokens' worth
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> jax.Array:  # [T, H, r]
    """The Pallas kernel behind `mla_absorbed_reference`'s contract: same inputs, same output.

    Launch parameters are sized for Triton's register budget (a 576-wide row), not tuned: no GPU was lent."""
    check_latent_inputs(q_latent, q_rope, latent_pages)
    _check_metadata(q_latent, latent_pages, md)
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    num_pages, page_size, _ = latent_pages.shape
    block_h = block_h or min(num_heads, 64)
    block_q = block_q or max(1, 16 // block_h)
    pages_per_block = pages_per_block or max(1, 64 // page_size)
    if num_heads % block_h or rank % rope_dim:
        raise ValueError(f"block_h={block_h} must divide the {num_heads} heads (q_latent.shape={q_latent.shape}) "
                         f"and qk_rope_head_dim={rope_dim} must divide kv_lora_rank={rank}")
    if not interpret:
        for what, n in (("block_q * block_h", block_q * block_h), ("pages_per_block * page_size",
                        pages_per_block * page_size), ("kv_lora_rank", rank), ("qk_rope_head_dim", rope_dim)):
            if not _is_pow2(n) or n < 16:
                raise ValueError(f"{what}={n} must be a power of two >= 16 for the Triton lowering")

    num_q_blocks = pl.cdiv(num_tokens, block_q)
    pad = ((0, num_q_blocks * block_q - num_tokens), (0, 0), (0, 0))
    q_lat, q_rot = jnp.pad(q_latent, pad), jnp.pad(q_rope.astype(q_latent.dtype), pad)
    page_indices = _pad_pages(md.page_indices, pages_per_block)
    first_seq, last_seq = _block_seq_ranges(md, num_q_blocks, block_q)
    scale = jnp.ones(1, jnp.float32) if latent_scale is None else jnp.reshape(latent_scale, (1,)).astype(jnp.float32)

    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    q_spec = lambda d: pl.BlockSpec((block_q, block_h, d), lambda i, h: (i, h, 0))  # noqa: E731
    c_spec = pl.BlockSpec((num_pages, page_size, rank), lambda i, h: (0, 0, 0))
    rope_spec = pl.BlockSpec((num_pages, page_size, rope_dim), lambda i, h: (0, 0, rank // rope_dim))
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, pages_per_block=pages_per_block),
        grid=(num_q_blocks, num_heads // block_h),
        in_specs=[whole(first_seq.shape), whole(last_seq.shape), whole(md.cu_q_lens.shape),
                  whole(md.kv_lens.shape), whole(page_indices.shape), whole(scale.shape),
                  q_spec(rank), q_spec(rope_dim), c_spec, rope_spec],
        out_specs=q_spec(rank),
        out_shape=jax.ShapeDtypeStruct(q_lat.shape, q_latent.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_absorbed_attention",
    )(first_seq, last_seq, md.cu_q_lens, md.kv_lens, page_indices, scale, q_lat, q_rot, latent_pages, latent_pages)
    return out[:num_tokens]
