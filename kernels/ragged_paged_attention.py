"""Ragged paged attention: one batch that mixes decodes and prefill chunks, K/V read through page tables.

Each sequence's new tokens (its queries) attend causally to themselves and fully to the sequence's
cached prefix. Queries are flat over tokens (`cu_q_lens` marks where each sequence starts); K/V live in
pages `[num_pages, page_size, num_kv_heads, head_dim]` addressed by `page_indices`.

This file holds, as JAX's own Pallas ops do, the Pallas kernel, its wrapper (input checks, layout), the
jitted API `ragged_paged_attention`, the pure-JAX reference (every token gathers its own sequence's
pages: simple, the correctness yardstick), the pure-JAX XLA path `ragged_paged_attention_xla` (the CPU
"xla" backend of the engine: the kernel's query-block structure in batched XLA ops, see its section) and
the op that writes a step's new K/V into the pages (kept separate: the kernel only reads pages).

FP8 pages (`--kv-cache-dtype fp8*`): the write quantizes (`quantize_kv`: x / scale, clipped to the
format's finite range, rounded to nearest even) and every attention path takes `kv_scales` = [K scale,
V scale] of the layer and dequantizes on read, inside its loops: a K or V tile is loaded in 8 bits and
converted to the compute dtype there, the K scale multiplies the scores (folded into the softmax
scale) and the V scale the output. That is the same math as multiplying every loaded element by its
scale, with one multiply per score row instead of one per element. Without `kv_scales` pages are read
as they are (any float dtype).

The kernel. Grid = (query blocks of `block_q` tokens, KV heads). One program owns the
`block_q * group` query rows of one block and one KV head (rows are token-major: row r is token
`r // group`, query head `kv_head * group + r % group`, so GQA shares every K/V load across the group).
The wrapper computes, as data, the first and last sequence each query block touches; the program loops
over those sequences (`fori_loop`, dynamic bounds) and, for each, over its KV blocks of
`pages_per_block` pages read through `page_indices`, only as far as the block's last query may see.
Scores are masked by sequence membership and causality (query at position p sees KV positions <= p),
then folded into an fp32 online softmax (running max, denominator, accumulator). A decode-only block
thus visits up to `block_q` short sequences; a prefill block usually one. Nothing here depends on the
decode/prefill mix as shape: a new mix is new data and compiles nothing.

Triton (the only Pallas GPU lowering that takes ROCm) is the target: metadata arrives as plain int32
inputs read with scalar loads (there is no scalar prefetch), every loaded tile is a power of two, dots
are at least 16 wide. The same code runs anywhere with `interpret=True`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcpp.kernels import cpu_attention
from jaxcpp.kernels.metadata import AttentionMetadata

Array = jax.Array

DEFAULT_KV_BLOCK_TOKENS = 128  # KV positions visited per loop iteration of the reference
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(MASK - m) is 0, never NaN


class BlockSizes(NamedTuple):
    q_rows: int  # query rows per program (tokens x query heads of one KV head); block_q = q_rows // group
    kv_tokens: int  # KV positions per inner step; pages_per_block = kv_tokens // page_size
    num_warps: int  # Triton launch parameters
    num_stages: int


# Defaults keyed by (head_dim, page_size). Chosen for Triton register budgets, NOT tuned on a GPU
# (none was lent yet): benchmarks/kernels.py is the place to tune them.
BLOCK_SIZES: dict[tuple[int, int], BlockSizes] = {
    (64, 16): BlockSizes(q_rows=64, kv_tokens=64, num_warps=4, num_stages=2),
    (64, 64): BlockSizes(q_rows=64, kv_tokens=64, num_warps=4, num_stages=2),
    (128, 16): BlockSizes(q_rows=64, kv_tokens=64, num_warps=4, num_stages=2),
    (128, 64): BlockSizes(q_rows=64, kv_tokens=64, num_warps=4, num_stages=2),
    (256, 16): BlockSizes(q_rows=32, kv_tokens=32, num_warps=8, num_stages=1),
    (256, 64): BlockSizes(q_rows=32, kv_tokens=64, num_warps=8, num_stages=1),
}
# AMD: 64-wide wavefronts, so fewer warps fill a CU; single-stage pipelining is the safe Triton default.
ROCM_LAUNCH = {"num_warps": 4, "num_stages": 1}


def default_block_sizes(head_dim: int, page_size: int, *, rocm: bool = False) -> BlockSizes:
    sizes = BLOCK_SIZES.get((head_dim, page_size), BlockSizes(64, max(64, page_size), 4, 2))
    return sizes._replace(**ROCM_LAUNCH) if rocm else sizes


def is_fp8(dtype: Any) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def quantize_kv(x: jax.Array, scale: jax.Array | float, dtype: Any) -> jax.Array:
    """x / scale in float32, clipped to `dtype`'s finite range (e4m3fn has no infinity: an overflow
    would be NaN), then rounded to nearest even by the cast: ml_dtypes' cast of the same float32."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array | float) -> jax.Array:
    return x.astype(jnp.float32) * scale


def write_kv_pages(
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32
    kv_scales: jax.Array | None = None,  # [2] float32: K and V scale of fp8 pages
) -> tuple[jax.Array, jax.Array]:
    """Scatter the step's new K/V into their slots (padding tokens land in the never-used page 0);
    fp8 pages store K / k_scale and V / v_scale, quantized."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales[0], k_pages.dtype), quantize_kv(v, kv_scales[1], v_pages.dtype)
    k_pages = k_pages.reshape(flat_shape).at[slot_mapping].set(k.astype(k_pages.dtype)).reshape(k_pages.shape)
    v_pages = v_pages.reshape(flat_shape).at[slot_mapping].set(v.astype(v_pages.dtype)).reshape(v_pages.shape)
    return k_pages, v_pages


def token_layout(md: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """For each token: its sequence and how many KV positions it may see (causal; padding tokens: 0)."""
    num_seqs_padded = md.kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(md.cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs_padded - 1)
    is_real = token < md.cu_q_lens[md.num_seqs]
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    # A query at offset i of a sequence whose new tokens end at kv_len sits at kv_len - q_len + i.
    q_pos = md.kv_lens[seq] - q_lens[seq] + (token - md.cu_q_lens[seq])
    kv_visible = jnp.where(is_real, q_pos + 1, 0)
    return seq, kv_visible


def _pad_pages(page_indices: jax.Array, block_pages: int) -> jax.Array:
    """Pad a page table's columns with page 0 to a multiple of `block_pages` (never read unmasked)."""
    return jnp.pad(page_indices, ((0, 0), (0, -page_indices.shape[1] % block_pages)))


def _online_softmax_step(m: Array, denom: Array, acc: Array, scores: Array, mask: Array, v: Array,
                         contract: str) -> tuple[Array, Array, Array]:
    """Fold one block of fp32 scores (masked entries: anything) into the running max, denominator, sum."""
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    correction = jnp.exp(m - m_new)  # rows this block leaves untouched keep m, so 1
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    denom = denom * correction + p.sum(axis=-1)
    return m_new, denom, acc * correction[..., None] + jnp.einsum(contract, p, v)


def _per_token_attention(qg: Array, k_pages: Array, v_pages: Array, token_pages: Array, kv_visible: Array, *,
                         block_pages: int) -> Array:
    """Every token gathers its own pages, block by block, only as far as the longest `kv_visible`.

    qg: [N, kv_heads, group, head_dim] fp32, already scaled; token_pages: [N, P] each token's page
    table; kv_visible: [N] KV positions each token sees (0: the token comes out 0).
    """
    n, num_kv_heads, group, head_dim = qg.shape
    block_tokens = block_pages * k_pages.shape[1]
    token_pages = _pad_pages(token_pages, block_pages)
    num_blocks = (jnp.max(kv_visible) + block_tokens - 1) // block_tokens

    def body(state: Any) -> Any:
        i, m, denom, acc = state
        pages = lax.dynamic_slice_in_dim(token_pages, i * block_pages, block_pages, axis=1)
        k = k_pages[pages].reshape(n, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        v = v_pages[pages].reshape(n, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        scores = jnp.einsum("tkgd,tnkd->tkgn", qg, k)
        mask = (i * block_tokens + jnp.arange(block_tokens) < kv_visible[:, None])[:, None, None, :]
        return (i + 1, *_online_softmax_step(m, denom, acc, scores, mask, v, "tkgn,tnkd->tkgd"))

    stats = (n, num_kv_heads, group)
    init = (jnp.int32(0), jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, head_dim), jnp.float32))
    _, _, denom, acc = lax.while_loop(lambda s: s[0] < num_blocks, body, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [N, kv_heads, group, head_dim]


def _scaled_groups(q: jax.Array, num_kv_heads: int, sm_scale: float | None,
                   kv_scales: jax.Array | None = None) -> jax.Array:
    """q [T, num_heads, head_dim] -> fp32 [T, kv_heads, group, head_dim], times the softmax scale (and
    fp8 pages' K scale: q . (s k) = (s q) . k, so K tiles dequantize with their cast alone)."""
    num_tokens, num_heads, head_dim = q.shape
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    q32 = q.astype(jnp.float32) * scale
    if kv_scales is not None:
        q32 = q32 * kv_scales[0]
    return q32.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _times_v_scale(out: jax.Array, kv_scales: jax.Array | None) -> jax.Array:
    """fp8 pages: the V scale, applied once to the fp32 output (sum_j p_j (s v_j) = s sum_j p_j v_j)."""
    return out if kv_scales is None else out * kv_scales[1]


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    kv_scales: jax.Array | None = None,  # [2] float32: K and V scale of fp8 pages
    *,
    sm_scale: float | None = None,
    kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS,
) -> jax.Array:  # [T, num_heads, head_dim]
    """Online-softmax attention over KV blocks, looping only as far as the batch's longest context.

    Every token gathers its own sequence's pages, so the work is proportional to the KV each token
    really sees, and the loop's trip count is data, not shape. Padding tokens see nothing: 0.
    """
    _, page_size, num_kv_heads, _ = k_pages.shape
    seq, kv_visible = token_layout(md, q.shape[0])
    out = _per_token_attention(_scaled_groups(q, num_kv_heads, sm_scale, kv_scales), k_pages, v_pages,
                               md.page_indices[seq], kv_visible,
                               block_pages=max(1, kv_block_tokens // page_size))
    return _times_v_scale(out, kv_scales).reshape(q.shape).astype(q.dtype)


# ----------------------------------------------------------------------------------------------- kernel


def _kernel(
    first_seq_ref: Any,  # [num_q_blocks] int32: first sequence touching each query block
    last_seq_ref: Any,  # [num_q_blocks] int32: last one (first > last: the block is padding)
    cu_q_lens_ref: Any,  # [S + 1] int32
    kv_lens_ref: Any,  # [S] int32
    page_indices_ref: Any,  # [S, P'] int32, P' a multiple of pages_per_block
    kv_scales_ref: Any,  # [2] float32: K and V scale (1, 1 for pages stored as they are)
    q_ref: Any,  # [block_q, group, head_dim]
    k_pages_ref: Any,  # [num_pages, page_size, head_dim] (this program's KV head)
    v_pages_ref: Any,  # [num_pages, page_size, head_dim]
    o_ref: Any,  # [block_q, group, head_dim]
    *,
    sm_scale: float,
    pages_per_block: int,
) -> None:
    block_q, group, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    rows, block_kv = block_q * group, pages_per_block * page_size
    q_block = pl.program_id(0)
    t0 = q_block * block_q
    q = q_ref[...].reshape(rows, head_dim)
    # fp8 pages dequantize on read: a tile's cast below, and its scale folded into the scores' (K) and
    # the output's (V) multiplier
    k_scale, v_scale = kv_scales_ref[0], kv_scales_ref[1]
    score_scale = sm_scale * k_scale
    row_token = t0 + jnp.arange(rows, dtype=jnp.int32)[:, None] // group  # [rows, 1]
    kv_offsets = jnp.arange(block_kv, dtype=jnp.int32)[None, :]  # [1, block_kv]

    def visit_sequence(s: Array, carry: Any) -> Any:
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        first_pos = kv_len - (q_end - q_start)  # position of the sequence's first new token
        lo, hi = jnp.maximum(q_start, t0), jnp.minimum(q_end, t0 + block_q)
        # The block's last query of this sequence sees the most KV; nothing past it is read.
        kv_end = jnp.where(hi > lo, first_pos + hi - q_start, 0)
        in_seq = (row_token >= lo) & (row_token < hi)
        visible = jnp.where(in_seq, first_pos + row_token - q_start + 1, 0)  # [rows, 1]

        def visit_kv_block(j: Array, carry: Any) -> Any:
            m, denom, acc = carry
            pages = page_indices_ref[s, pl.ds(j * pages_per_block, pages_per_block)]
            k = k_pages_ref[pages].reshape(block_kv, head_dim).astype(q.dtype)
            v = v_pages_ref[pages].reshape(block_kv, head_dim).astype(q.dtype)
            scores = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            ) * score_scale
            mask = j * block_kv + kv_offsets < visible  # [rows, block_kv]
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(axis=1))
            correction = jnp.exp(m - m_new)  # rows untouched by this block keep m, so 1
            p = jnp.where(mask, jnp.exp(scores - m_new[:, None]), 0.0)
            denom = denom * correction + p.sum(axis=1)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return m_new, denom, acc * correction[:, None] + pv

        return lax.fori_loop(0, pl.cdiv(kv_end, block_kv), visit_kv_block, carry)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(first_seq_ref[q_block], last_seq_ref[q_block] + 1, visit_sequence, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None] * v_scale  # padding rows saw nothing: 0
    o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------- wrapper


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata) -> None:
    """Raise ValueError naming the shapes when the inputs break the layout contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got q.shape={q.shape}")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_pages, page_size, num_kv_heads, head_dim], "
                         f"got k_pages.shape={k_pages.shape}, v_pages.shape={v_pages.shape}")
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim differs: q.shape={q.shape}, k_pages.shape={k_pages.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} (q.shape={q.shape}) is not a multiple of "
                         f"num_kv_heads={num_kv_heads} (k_pages.shape={k_pages.shape})")
    num_seqs = md.kv_lens.shape[0] if md.kv_lens.ndim == 1 else -1
    expected = {
        "cu_q_lens": (num_seqs + 1,), "kv_lens": (num_seqs,), "positions": (num_tokens,),
        "slot_mapping": (num_tokens,), "num_seqs": (), "num_decodes": (),
    }
    for name, shape in expected.items():
        arr = getattr(md, name)
        if arr.shape != shape or arr.dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32 {list(shape)} for q.shape={q.shape}, "
                             f"kv_lens.shape={md.kv_lens.shape}; got {arr.dtype}{list(arr.shape)}")
    pages = md.page_indices
    if pages.ndim != 2 or pages.shape[0] != num_seqs or pages.dtype != jnp.int32:
        raise ValueError(f"md.page_indices must be int32 [S={num_seqs}, pages_per_seq], "
                         f"got {md.page_indices.dtype}{list(md.page_indices.shape)}")


def check_block_sizes(
    q: jax.Array, k_pages: jax.Array, *, block_q: int, pages_per_block: int, interpret: bool
) -> None:
    """Raise ValueError when the block sizes cannot tile; compiled, Triton's tile rules apply too."""
    num_heads, head_dim = q.shape[1:]
    page_size, num_kv_heads = k_pages.shape[1:3]
    if block_q < 1 or pages_per_block < 1:
        raise ValueError(f"block sizes must be positive: {block_q=}, {pages_per_block=}")
    if not interpret:  # Triton: power-of-two tiles, dots at least 16 wide
        group, block_kv = num_heads // num_kv_heads, pages_per_block * page_size
        for what, n in (("block_q * group", block_q * group), ("pages_per_block * page_size", block_kv),
                        ("head_dim", head_dim)):
            if not _is_pow2(n) or n < 16:
                raise ValueError(f"{what}={n} must be a power of two >= 16 for the Triton lowering "
                                 f"(q.shape={q.shape}, k_pages.shape={k_pages.shape}, block_q={block_q}, "
                                 f"pages_per_block={pages_per_block})")


def _block_seq_ranges(
    md: AttentionMetadata, num_q_blocks: int, block_q: int, first_token: jax.Array | int = 0
) -> tuple[jax.Array, jax.Array]:
    """First and last real sequence each query block touches among tokens >= `first_token`
    (first > last for blocks with no such token)."""
    t0 = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    t_first = jnp.maximum(t0, first_token)
    t_last = jnp.minimum(t0 + block_q, md.cu_q_lens[md.num_seqs]) - 1
    seq_ends = md.cu_q_lens[1:]
    first = jnp.searchsorted(seq_ends, t_first, side="right").astype(jnp.int32)
    last = jnp.searchsorted(seq_ends, t_last, side="right").astype(jnp.int32)
    empty = t_first > t_last
    return jnp.where(empty, 0, first), jnp.where(empty, -1, last)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_q", "pages_per_block", "num_warps", "num_stages", "interpret"),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    kv_scales: jax.Array | None = None,  # [2] float32: K and V scale of fp8 pages
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,  # query tokens per program; default from BLOCK_SIZES
    pages_per_block: int | None = None,  # KV pages per inner step; default from BLOCK_SIZES
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, num_heads, head_dim]
    """The Pallas kernel behind the reference's contract: same inputs, same output, fp32 accumulation."""
    check_inputs(q, k_pages, v_pages, md)
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    sizes = default_block_sizes(head_dim, page_size)
    block_q = block_q or max(1, sizes.q_rows // group)
    pages_per_block = pages_per_block or max(1, sizes.kv_tokens // page_size)
    check_block_sizes(q, k_pages, block_q=block_q, pages_per_block=pages_per_block, interpret=interpret)

    num_q_blocks = pl.cdiv(num_tokens, block_q)
    padded_tokens = num_q_blocks * block_q
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    page_indices = _pad_pages(md.page_indices, pages_per_block)
    first_seq, last_seq = _block_seq_ranges(md, num_q_blocks, block_q)
    scales = jnp.ones(2, jnp.float32) if kv_scales is None else kv_scales.astype(jnp.float32)

    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda i, h: (0, 0, h, 0))
    q_spec = pl.BlockSpec((block_q, None, group, head_dim), lambda i, h: (i, h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale,
                          pages_per_block=pages_per_block),
        grid=(num_q_blocks, num_kv_heads),
        in_specs=[
            whole(first_seq.shape), whole(last_seq.shape), whole(md.cu_q_lens.shape),
            whole(md.kv_lens.shape), whole(page_indices.shape), whole(scales.shape), q_spec, kv_spec, kv_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or sizes.num_warps, num_stages=num_stages or sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(first_seq, last_seq, md.cu_q_lens, md.kv_lens, page_indices, scales, qg, k_pages, v_pages)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim)


# ------------------------------------------------------------------------------------- XLA (CPU) path

DEFAULT_XLA_BLOCK_Q = 64  # query tokens per block of the XLA path's prefill part
DEFAULT_XLA_KV_BLOCK_TOKENS = 128  # KV positions per inner step of the XLA path (CPU: 128 beat 64, 256, 512)
# Query blocks computed together, each group only as far as its own last query sees (CPU, one core: 1
# beat 2, 4 and all at once on every shape tried, lone chunks and mixes; docs/benchmarks.md).
DEFAULT_XLA_GROUP_BLOCKS = 1
# Heads of 64 and wider: blocks of 256 x 256 (a 512-token chunk after 512 cached tokens, the 30m model's
# 8 / 4 heads of 64: 15.6 ms a layer against 23.0 at 64 x 128; the bundled model's heads of 32 stay
# fastest at 64 x 128: 4.8 against 5.6 ms; benchmarks/cpu_prefill_split.py attention, docs/benchmarks.md).
WIDE_HEAD_DIM = 64
WIDE_XLA_BLOCKS = (256, 256)


def xla_prefill_blocks(head_dim: int) -> tuple[int, int]:
    """The XLA path's (query block, KV block tokens) for prefill chunks of this head size."""
    return WIDE_XLA_BLOCKS if head_dim >= WIDE_HEAD_DIM else (DEFAULT_XLA_BLOCK_Q, DEFAULT_XLA_KV_BLOCK_TOKENS)


def _prefill_attention(qg: Array, k_pages: Array, v_pages: Array, md: AttentionMetadata, *, block_q: int,
                       block_pages: int, group_blocks: int = DEFAULT_XLA_GROUP_BLOCKS) -> Array:
    """Prefill tokens in query blocks; each block gathers each sequence it touches ONCE for all its tokens.

    qg: [T, kv_heads, group, head_dim] fp32, already scaled. The query blocks go in groups of
    `group_blocks`, one group after the other, and a group visits KV blocks only as far as its own
    furthest query sees: a chunk of x new tokens after L cached ones then costs about x·L + x²/2 block
    pairs (the causal triangle, as the kernel's grid does), where one batch of every block would pay
    x·(L + x), the first query as far as the last. That is the latency model's shape, 2Lx + x², which
    calibration fits and dynamic chunking plans with. Decode and padding tokens come out 0.
    """
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    num_q_blocks = -(-num_tokens // block_q)
    group_blocks = max(1, min(group_blocks, num_q_blocks))
    num_groups = -(-num_q_blocks // group_blocks)
    padded = num_groups * group_blocks * block_q

    seq, kv_visible = token_layout(md, num_tokens)
    prefill_start = md.cu_q_lens[md.num_decodes]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    kv_visible = jnp.where(token >= prefill_start, kv_visible, 0)  # decodes and padding see nothing
    pad_t = padded - num_tokens
    grouped = (num_groups, group_blocks, block_q)
    tok_seq = jnp.pad(seq, (0, pad_t), constant_values=-1).reshape(grouped)
    tok_visible = jnp.pad(kv_visible, (0, pad_t)).reshape(grouped)
    first, last = _block_seq_ranges(md, num_groups * group_blocks, block_q, prefill_start)  # prefill only
    first, last = first.reshape(num_groups, group_blocks), last.reshape(num_groups, group_blocks)
    # [groups, blocks, kv_heads, block_q, group, head_dim]: one batched matmul per block and KV head.
    qb = jnp.pad(qg, ((0, pad_t), (0, 0), (0, 0), (0, 0)))
    qb = qb.reshape(*grouped, num_kv_heads, group, head_dim).transpose(0, 1, 3, 2, 4, 5)
    pages_of = _pad_pages(md.page_indices, block_pages)

    def one_group(g: Array, out: Array) -> Array:
        part = _prefill_blocks(qb[g], tok_seq[g], tok_visible[g], first[g], last[g], k_pages, v_pages,
                               pages_of, block_pages=block_pages)
        return lax.dynamic_update_index_in_dim(out, part, g, axis=0)

    out = lax.fori_loop(0, num_groups, one_group, jnp.zeros_like(qb))
    out = out.transpose(0, 1, 3, 2, 4, 5).reshape(padded, num_kv_heads, group, head_dim)
    return out[:num_tokens]


def _prefill_blocks(qb: Array, tok_seq: Array, tok_visible: Array, first: Array, last: Array, k_pages: Array,
                    v_pages: Array, pages_of: Array, *, block_pages: int) -> Array:
    """Attention of a few query blocks at once: qb [blocks, kv_heads, block_q, group, head_dim].

    For every block, the prefill sequences it touches form a range [first, last]; step j visits sequence
    first + j of every block at once (trip count: the widest range), and for it the KV blocks up to the
    furthest position any of these blocks' tokens of that sequence see.
    """
    num_q_blocks, num_kv_heads, block_q, group, head_dim = qb.shape
    num_seqs_padded = pages_of.shape[0]
    block_tokens = block_pages * k_pages.shape[1]
    span = jnp.max(last - first + 1)
    kv_offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    def visit_sequence(state: Any) -> Any:
        j, m, denom, acc = state
        s = first + j  # [blocks]
        active = s <= last
        in_seq = (tok_seq == s[:, None]) & active[:, None]  # [blocks, block_q]
        visible = jnp.where(in_seq, tok_visible, 0)
        num_kv = (jnp.max(visible) + block_tokens - 1) // block_tokens
        block_pages_of = pages_of[jnp.clip(s, 0, num_seqs_padded - 1)]  # [blocks, P']

        def visit_kv_block(inner: Any) -> Any:
            i, m, denom, acc = inner
            pages = lax.dynamic_slice_in_dim(block_pages_of, i * block_pages, block_pages, axis=1)
            shape = (num_q_blocks, block_tokens, num_kv_heads, head_dim)
            k = k_pages[pages].reshape(shape).astype(jnp.float32)
            v = v_pages[pages].reshape(shape).astype(jnp.float32)
            scores = jnp.einsum("bkqgd,bnkd->bkqgn", qb, k)
            mask = (i * block_tokens + kv_offsets < visible[..., None])[:, None, :, None, :]
            return (i + 1, *_online_softmax_step(m, denom, acc, scores, mask, v, "bkqgn,bnkd->bkqgd"))

        _, m, denom, acc = lax.while_loop(lambda c: c[0] < num_kv, visit_kv_block, (jnp.int32(0), m, denom, acc))
        return j + 1, m, denom, acc

    stats = (num_q_blocks, num_kv_heads, block_q, group)
    init = (jnp.int32(0), jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, head_dim), jnp.float32))
    _, _, denom, acc = lax.while_loop(lambda s: s[0] < span, visit_sequence, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


DECODE_GROUP_ROWS = 8  # decode rows per group of the XLA path: each group loops to its own longest row


def _decode_attention(qg: Array, k_pages: Array, v_pages: Array, page_indices: Array, kv_visible: Array, *,
                      block_pages: int) -> Array:
    """The reference's per-token gather for decode rows, with rows sorted by context length and cut into
    groups of `DECODE_GROUP_ROWS`, each looping over KV blocks only as far as its own longest row. The
    pages gathered then follow the rows' real contexts (sum over rows, not rows x the longest), and
    padding rows (context 0) gather nothing. Every row meets the same blocks in the same order as in
    the reference, so its result does not depend on the rows beside it."""
    n = qg.shape[0]
    group = min(DECODE_GROUP_ROWS, n)
    padded = -(-n // group) * group
    order = jnp.argsort(kv_visible)  # [n]
    rows = jnp.pad(order, (0, padded - n))  # padding slots repeat row 0 with nothing visible
    visible = jnp.pad(kv_visible[order], (0, padded - n))
    q_sorted, pages_sorted = qg[rows], page_indices[rows]

    def visit_group(g: Array, out: Array) -> Array:  # one compiled body, whatever the group count
        start = g * group
        def take(x: Array) -> Array:
            return lax.dynamic_slice_in_dim(x, start, group)

        part = _per_token_attention(take(q_sorted), k_pages, v_pages, take(pages_sorted), take(visible),
                                    block_pages=block_pages)
        return lax.dynamic_update_slice_in_dim(out, part, start, axis=0)

    sorted_out = lax.fori_loop(0, padded // group, visit_group, jnp.zeros_like(q_sorted))[:n]
    return jnp.zeros_like(sorted_out).at[order].set(sorted_out)


CPU_KERNELS = ("auto", "cpp", "xla")  # C++ custom call reading pages in place, or XLA ops


def _use_cpp_kernel(choice: str, part: str, k_pages: jax.Array, v_pages: jax.Array) -> bool:
    """Whether `part` ("decode", "prefill") takes its C++ kernel: "auto" on CPU for float32 pages where it
    builds and `JAXCPP_CPU_ATTENTION_KERNEL` allows it."""
    field = f"{part}_kernel"
    if choice not in CPU_KERNELS:
        raise ValueError(f"{field} must be one of {CPU_KERNELS}, got {choice!r}")
    if choice == "xla":
        return False
    fits = jax.default_backend() == "cpu" and k_pages.dtype == v_pages.dtype == jnp.float32
    usable = fits and cpu_attention.enabled(part) and cpu_attention.available()
    if choice == "cpp" and not usable:
        raise ValueError(f"{field}='cpp' needs the CPU backend, float32 pages (got {k_pages.dtype}), a C++ "
                         f"compiler to build {cpu_attention.SOURCE.name} (see the log) and "
                         f"{cpu_attention.SWITCH_ENV} unset or {part!r}")
    return usable


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    kv_scales: jax.Array | None = None,  # [2] float32: K and V scale of fp8 pages
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,  # default: `xla_prefill_blocks(head_dim)`
    kv_block_tokens: int | None = None,
    group_blocks: int = DEFAULT_XLA_GROUP_BLOCKS,
    decode_kernel: str = "auto",
    prefill_kernel: str = "auto",
) -> jax.Array:  # [T, num_heads, head_dim]
    """The reference's contract and math: the CPU path.

    Decodes (the first `num_decodes` tokens, restricted to the first S tokens) go, per `decode_kernel`,
    through the C++ custom call that reads their pages in place ("cpp"; `cpu_attention`) or the
    reference's per-token gather in XLA ops ("xla"); prefill tokens, per `prefill_kernel`, through the
    C++ prefill call or `_prefill_attention` (KV gathered once per query block). "auto" takes the C++
    ones on CPU for float32 pages where they build. Each token belongs to exactly one part and the other
    gives it 0. All loop bounds are data: a new decode/prefill mix compiles nothing.
    """
    num_tokens = q.shape[0]
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    default_q, default_kv = xla_prefill_blocks(head_dim)
    block_q, kv_block_tokens = block_q or default_q, kv_block_tokens or default_kv
    block_pages = max(1, kv_block_tokens // page_size)
    block_q = max(1, min(block_q, num_tokens))

    qg = _scaled_groups(q, num_kv_heads, sm_scale, kv_scales)
    # Decodes: the first S tokens, each its own sequence (token i is sequence i); the rest see nothing.
    n = min(md.kv_lens.shape[0], num_tokens)
    kv_visible = jnp.where(jnp.arange(n) < md.num_decodes, md.kv_lens[:n], 0)
    if _use_cpp_kernel(decode_kernel, "decode", k_pages, v_pages):
        decode = cpu_attention.paged_decode_attention(qg[:n], k_pages, v_pages, md.page_indices[:n], kv_visible)
    else:
        decode = _decode_attention(qg[:n], k_pages, v_pages, md.page_indices[:n], kv_visible,
                                   block_pages=block_pages)
    if _use_cpp_kernel(prefill_kernel, "prefill", k_pages, v_pages):
        prefill = cpu_attention.paged_prefill_attention(qg, k_pages, v_pages, md)
    else:
        prefill = _prefill_attention(qg, k_pages, v_pages, md, block_q=block_q, block_pages=block_pages,
                                     group_blocks=group_blocks)
    out = prefill.at[:n].add(decode)  # disjoint: each part gives the other's tokens 0
    return _times_v_scale(out, kv_scales).reshape(q.shape).astype(q.dtype)
