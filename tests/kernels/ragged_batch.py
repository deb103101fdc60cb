"""Test helper: a random ragged paged-attention batch (q, K/V pages, metadata) from per-sequence lengths."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxcpp.kernels.metadata import AttentionMetadata


def ragged_batch(q_lens: list[int], prefixes: list[int], *, num_tokens: int, num_seqs: int, max_kv_len: int,
                 num_kv_heads: int, head_dim: int, page_size: int, group: int, dtype, seed: int = 0):
    """Sequences (decodes first) with `q_lens` new tokens after `prefixes` cached ones, padded to
    `num_tokens` tokens and `num_seqs` sequences; pages handed out in shuffled order, page 0 unused."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max_kv_len // page_size
    num_pages = 1 + num_seqs * pages_per_seq
    free = list(rng.permutation(np.arange(1, num_pages)))
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    for s, (q_len, prefix) in enumerate(zip(q_lens, prefixes, strict=True)):
        kv_lens[s] = prefix + q_len
        n = -(-kv_lens[s] // page_size)
        page_indices[s, :n] = [free.pop() for _ in range(n)]
        start = cu_q_lens[s]
        cu_q_lens[s + 1] = start + q_len
        pos = np.arange(prefix, prefix + q_len)
        positions[start:start + q_len] = pos
        slot_mapping[start:start + q_len] = page_indices[s, pos // page_size] * page_size + pos % page_size
    cu_q_lens[len(q_lens) + 1:] = cu_q_lens[len(q_lens)]
    assert cu_q_lens[-1] <= num_tokens and max(kv_lens, default=0) <= max_kv_len
    md = AttentionMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slot_mapping),
        cu_q_lens=jnp.asarray(cu_q_lens), kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(page_indices), num_seqs=jnp.int32(len(q_lens)),
        num_decodes=jnp.int32(sum(n == 1 for n in q_lens)),
    )
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
    pages = rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim))
    return jnp.asarray(q, dtype), jnp.asarray(pages[0], dtype), jnp.asarray(pages[1], dtype), md
