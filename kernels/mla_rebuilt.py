"""MLA's rebuilt prefill form with a Pallas kernel for its attention (`mla_prefill_rebuilt_attention`).

The rebuilt form (`kernels/mla_attention.py`, `mla_prefill_rebuilt_xla`) attends a prefill chunk with
per-head K [dn + dr] and V [dv] rebuilt from the latent pages: q/k head dim 192 and v head dim 128 for
DeepSeek-V3, which the ragged paged kernel (one head dim for q, K and V, read from pages) cannot serve.
Its cost model (`jaxcpp.chunking.mla_cost`) needs the rebuild — the kv_b_proj GEMM, 2·r·H·(dn + dv)
FLOPs a context token, the γ·L term — to happen ONCE per KV block per sequence, never once per query
block. So the work splits where the tools differ:

- XLA, per prefill sequence, per KV block of `kv_block_tokens` positions (the same outer loops as the
  XLA path, data-bounded: a new mix compiles nothing): `_rebuild_block` gathers the block's latent rows
  and runs the rebuild GEMM — on a GPU a cuBLAS / rocBLAS GEMM, the right tool for it — giving per-head
  k_nope [n, H, dn], the shared k_rope [n, dr] (one for all heads, as stored: never broadcast) and per-
  head V [n, H, dv]. The buffers are one block's, whatever the context length (vLLM's MLA backend
  rebuilds its chunked context by a bounded workspace too, then merges partial attention states).
- Pallas (`_fold_kernel`): fold that block into the fp32 online-softmax state (running max m [T, H],
  denominator [T, H], accumulator [T, H, dv]) of every query row that sees any of it. Grid = (query
  blocks of `block_q` tokens over the whole step, heads); a program owns one head's `block_q` rows
  (q/k dots are 2-D in Triton, and every head has its own K). Rows outside the sequence, and positions
  a row may not see (causal, or past the context), are masked; a program with nothing to see (a block
  of other sequences, or before the KV block: the causal skip) neither reads nor writes its state
  (`pl.when`; the aliased buffer keeps it: idle programs move no memory). The state is updated in
  place (`input_output_aliases`) across the launches of all sequences and blocks (their rows are
  disjoint); `acc / denom` once at the end, decode and padding rows 0. Inside a program the block is
  walked in tiles of `block_kv` positions, no further than the program's last row sees. Scores are
  q_nope · k_nope + q_rope · k_rope (two dots, so dn = 128 and dr = 64 stay powers of two where dn + dr
  = 192 is not).

Dtypes: the rebuild accumulates in fp32 (as the XLA path), then K/V (and the scaled queries) are cast to
the model's dtype for the kernel's dots, which accumulate in fp32 (flash attention's practice: bf16
models get tensor-core dots; float32 models compute exactly what the XLA path does). FP8 pages: the
scale is folded into the rebuild. Launch sizes are sized for Triton's register budget, not tuned: no
GPU was lent. Off a GPU the kernel runs with `interpret=True` (tests, `--attention-backend pallas` on
CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.mla_attention import (
    DEFAULT_REBUILD_KV_BLOCK_TOKENS,
    _check_metadata,
    _rebuild_block,
    check_latent_inputs,
)
from jaxcpp.kernels.ragged_paged_attention import MASK_VALUE, _is_pow2, _pad_pages

Array = jax.Array
State = tuple[Array, Array, Array]  # (m [T', H], denom [T', H], acc [T', H, dv]) fp32
DEFAULT_BLOCK_Q = 32  # query tokens (rows) per program
DEFAULT_BLOCK_KV = 32  # KV positions per inner step of a program


def _fold_kernel(
    bounds_ref: Any,  # [4] int32: q_start, q_end, first_pos (the chunk's first position), kv_start (the block's)
    q_nope_ref: Any,  # [block_q, dn]: this program's head, scaled by sm_scale
    q_rope_ref: Any,  # [block_q, dr]
    k_nope_ref: Any,  # [n', dn]: the rebuilt block, this head (n' = n rounded up to block_kv)
    k_rope_ref: Any,  # [n', dr]: shared by all heads
    v_ref: Any,  # [n', dv]: this head
    m_in_ref: Any,  # [block_q] fp32
    denom_in_ref: Any,  # [block_q] fp32
    acc_in_ref: Any,  # [block_q, dv] fp32
    m_ref: Any,  # the same three, aliased to the inputs: the state updated in place
    denom_ref: Any,
    acc_ref: Any,
    *,
    block_tokens: int,  # n: positions rebuilt in the block (rows past it are padding)
    block_kv: int,
) -> None:
    block_q = q_nope_ref.shape[0]
    q_start, q_end, first_pos, kv_start = bounds_ref[0], bounds_ref[1], bounds_ref[2], bounds_ref[3]
    t0 = pl.program_id(0) * block_q
    lo, hi = jnp.maximum(q_start, t0), jnp.minimum(q_end, t0 + block_q)
    # How many of the block's positions a row sees: causal, and none past the block; rows of other
    # sequences (and padding) none. The program's last row of the sequence sees the most.
    kv_end = jnp.where(hi > lo, jnp.clip(first_pos + hi - q_start - kv_start, 0, block_tokens), 0)
    row_token = t0 + jnp.arange(block_q, dtype=jnp.int32)[:, None]  # [block_q, 1]
    in_seq = (row_token >= lo) & (row_token < hi)
    visible = jnp.where(in_seq, jnp.clip(first_pos + row_token - q_start + 1 - kv_start, 0, block_tokens), 0)
    kv_offsets = jnp.arange(block_kv, dtype=jnp.int32)[None, :]
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32)
    contract = (((1,), (1,)), ((), ()))

    # A program with nothing to see neither reads nor writes its state: the aliased buffer keeps it (most
    # programs of a launch are idle; writing their [block_q, dv] back would move the whole state a launch).
    @pl.when(kv_end > 0)
    def fold_block() -> None:
        q_nope, q_rope = q_nope_ref[...], q_rope_ref[...]

        def visit_kv_tile(j: Array, carry: Any) -> Any:
            m, denom, acc = carry
            tile = pl.ds(j * block_kv, block_kv)
            k_nope, k_rope, v = k_nope_ref[tile, :], k_rope_ref[tile, :], v_ref[tile, :]
            scores = dot(q_nope, k_nope, contract) + dot(q_rope, k_rope, contract)  # [block_q, block_kv]
            mask = j * block_kv + kv_offsets < visible
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(axis=1))
            correction = jnp.exp(m - m_new)  # rows this tile leaves untouched keep m, so 1
            p = jnp.where(mask, jnp.exp(scores - m_new[:, None]), 0.0)
            denom = denom * correction + p.sum(axis=1)
            pv = dot(p.astype(v.dtype), v, (((1,), (0,)), ((), ())))
            return m_new, denom, acc * correction[:, None] + pv

        m, denom, acc = lax.fori_loop(0, pl.cdiv(kv_end, block_kv), visit_kv_tile,
                                      (m_in_ref[...], denom_in_ref[...], acc_in_ref[...]))
        m_ref[...] = m
        denom_ref[...] = denom
        acc_ref[...] = acc


def _fold(q_nope: Array, q_rope: Array, k_nope: Array, k_rope: Array, v: Array, state: State, bounds: Array, *,
          block_q: int, block_kv: int, num_warps: int, num_stages: int, interpret: bool) -> State:
    """One launch of `_fold_kernel`: the rebuilt block (k_nope [n, H, dn], k_rope [n, dr], v [n, H, dv])
    folded into `state` for the rows of the sequence `bounds` names."""
    padded, num_heads, nope = q_nope.shape
    block_tokens, rope, dv = k_nope.shape[0], k_rope.shape[-1], v.shape[-1]
    if block_tokens % block_kv:  # tiles past the block are masked (positions >= block_tokens)
        pad = -block_tokens % block_kv
        k_nope, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (k_nope, v))
        k_rope = jnp.pad(k_rope, ((0, pad), (0, 0)))
    rows = lambda *d: pl.BlockSpec((block_q, None, *d), lambda i, h: (i, h) + (0,) * len(d))  # noqa: E731
    head = lambda d: pl.BlockSpec((k_nope.shape[0], None, d), lambda i, h: (0, h, 0))  # noqa: E731
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    state_specs = [rows(), rows(), rows(dv)]
    return tuple(pl.pallas_call(
        functools.partial(_fold_kernel, block_tokens=block_tokens, block_kv=block_kv),
        grid=(padded // block_q, num_heads),
        in_specs=[whole(bounds.shape), rows(nope), rows(rope), head(nope), whole(k_rope.shape), head(dv),
                  *state_specs],
        out_specs=state_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
        input_output_aliases={6: 0, 7: 1, 8: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_rebuilt_fold",
    )(bounds, q_nope, q_rope, k_nope, k_rope, v, *state))


def _check_tiles(nope: int, rope: int, dv: int, block_q: int, block_kv: int) -> None:
    for what, n in (("block_q", block_q), ("block_kv", block_kv), ("qk_nope_head_dim", nope),
                    ("qk_rope_head_dim", rope), ("v_head_dim", dv)):
        if not _is_pow2(n) or n < 16:
            raise ValueError(f"{what}={n} must be a power of two >= 16 for the Triton lowering")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_q", "block_kv", "kv_block_tokens", "num_warps", "num_stages", "interpret"),
)
def mla_prefill_rebuilt_attention(
    q_nope: jax.Array,  # [T, H, dn]
    q_rope: jax.Array,  # [T, H, dr]
    latent_pages: jax.Array,  # [num_pages, page_size, r + dr]
    w_uk: jax.Array,  # [r, H, dn]
    w_uv: jax.Array,  # [r, H, dv]
    md: AttentionMetadata,
    latent_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    kv_block_tokens: int = DEFAULT_REBUILD_KV_BLOCK_TOKENS,  # positions rebuilt per launch (the workspace)
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> jax.Array:  # [T, H, dv]; decode and padding tokens 0
    """`mla_prefill_rebuilt_xla`'s contract (same inputs, same output) with the attention in Pallas: per
    prefill sequence, per KV block, the rebuild as an XLA GEMM once, then one `_fold_kernel` launch."""
    check_latent_inputs(q_nope, q_rope, latent_pages, w_uk=w_uk, w_uv=w_uv)
    _check_metadata(q_nope, latent_pages, md)
    num_tokens, num_heads, nope = q_nope.shape
    rope, dv = q_rope.shape[-1], w_uv.shape[-1]
    if not interpret:
        _check_tiles(nope, rope, dv, block_q, block_kv)
    dtype = q_nope.dtype
    block_pages = max(1, kv_block_tokens // latent_pages.shape[1])
    block_tokens = block_pages * latent_pages.shape[1]
    pages_of = _pad_pages(md.page_indices, block_pages)
    pad = ((0, -num_tokens % block_q), (0, 0), (0, 0))
    q_n, q_r = (jnp.pad((x.astype(jnp.float32) * sm_scale).astype(dtype), pad) for x in (q_nope, q_rope))
    scale = jnp.float32(1.0) if latent_scale is None else latent_scale.astype(jnp.float32)
    w_uk32, w_uv32 = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    fold = functools.partial(_fold, block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                             num_stages=num_stages, interpret=interpret)

    def one_sequence(s: Array, state: State) -> State:
        q_start, q_end, kv_len = md.cu_q_lens[s], md.cu_q_lens[s + 1], md.kv_lens[s]
        first_pos = kv_len - (q_end - q_start)

        def kv_block(i: Array, state: State) -> State:
            pages = lax.dynamic_slice_in_dim(pages_of[s], i * block_pages, block_pages)
            k_nope, k_rope, v = (x.astype(dtype) for x in _rebuild_block(latent_pages, pages, w_uk32, w_uv32, scale))
            bounds = jnp.stack([q_start, q_end, first_pos, i * block_tokens]).astype(jnp.int32)
            return fold(q_n, q_r, k_nope, k_rope, v, state, bounds)

        return lax.fori_loop(0, (kv_len + block_tokens - 1) // block_tokens, kv_block, state)

    padded = q_n.shape[0]
    state = (jnp.full((padded, num_heads), MASK_VALUE, jnp.float32), jnp.zeros((padded, num_heads), jnp.float32),
             jnp.zeros((padded, num_heads, dv), jnp.float32))
    _, denom, acc = lax.fori_loop(md.num_decodes, md.num_seqs, one_sequence, state)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out[:num_tokens].astype(dtype)
