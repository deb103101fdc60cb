"""Ragged paged attention: one batch that mixes decodes and prefill chunks, K/V read through page tables.

Each sequence's new tokens (its queries) attend causally to themselves and fully to the sequence's
cached prefix. Queries are flat over tokens (`cu_q_lens` marks where each sequence starts); K/V live in
pages `[num_pages, page_size, num_kv_heads, head_dim]` addressed by `page_indices`.

This file holds the pure-JAX reference, which is also the CPU ("xla") path of the engine, and the op
that writes a step's new K/V into the pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcpp.kernels.metadata import AttentionMetadata

DEFAULT_KV_BLOCK_TOKENS = 128  # KV positions visited per loop iteration of the reference


def write_kv_pages(
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatter the step's new K/V into their slots (padding tokens land in the never-used page 0)."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_pages = k_pages.reshape(flat_shape).at[slot_mapping].set(k.astype(k_pages.dtype)).reshape(k_pages.shape)
    v_pages = v_pages.reshape(flat_shape).at[slot_mapping].set(v.astype(v_pages.dtype)).reshape(v_pages.shape)
    return k_pages, v_pages


def token_layout(md: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each token: its sequence, how many KV positions it may see (causal), and whether it is real."""
    num_seqs_padded = md.kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(md.cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs_padded - 1)
    is_real = token < md.cu_q_lens[md.num_seqs]
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    # A query at offset i of a sequence whose new tokens end at kv_len sits at kv_len - q_len + i.
    q_pos = md.kv_lens[seq] - q_lens[seq] + (token - md.cu_q_lens[seq])
    kv_visible = jnp.where(is_real, q_pos + 1, 0)
    return seq, kv_visible, is_real


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    *,
    sm_scale: float | None = None,
    kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS,
) -> jax.Array:  # [T, num_heads, head_dim]
    """Online-softmax attention over KV blocks, looping only as far as the batch's longest context.

    Every token gathers its own sequence's pages, so the work is proportional to the KV each token
    really sees, and the loop's trip count is data, not shape.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    pages_per_block = max(1, kv_block_tokens // page_size)
    block_tokens = pages_per_block * page_size

    seq, kv_visible, is_real = token_layout(md, num_tokens)
    token_pages = md.page_indices[seq]  # [T, P]
    pad = (-token_pages.shape[1]) % pages_per_block
    token_pages = jnp.pad(token_pages, ((0, 0), (0, pad)))
    num_blocks = (jnp.max(kv_visible) + block_tokens - 1) // block_tokens

    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads, group, head_dim)

    def body(state):
        i, m, l, acc = state
        pages = jax.lax.dynamic_slice_in_dim(token_pages, i * pages_per_block, pages_per_block, axis=1)
        k = k_pages[pages].reshape(num_tokens, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        v = v_pages[pages].reshape(num_tokens, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        s = jnp.einsum("tkgd,tnkd->tkgn", qg, k)
        kv_pos = i * block_tokens + jnp.arange(block_tokens)
        visible = (kv_pos[None, :] < kv_visible[:, None])[:, None, None, :]
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen nothing yet
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("tkgn,tnkd->tkgd", p, v)
        return i + 1, m_new, l, acc

    stats_shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.int32(0),
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )
    _, _, l, acc = jax.lax.while_loop(lambda s: s[0] < num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(is_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
