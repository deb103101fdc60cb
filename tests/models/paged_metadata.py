"""Test helper: AttentionMetadata for one step, built by hand from (pages, start, num_new) per sequence."""

import jax.numpy as jnp
import numpy as np

from jaxcpp.kernels.metadata import AttentionMetadata


def build_metadata(chunks, num_tokens_padded, page_size, pages_per_seq=8, num_seqs_padded=4):
    """`chunks` = [(pages, start, num_new)] per sequence, decodes first; padding writes to page 0."""
    positions, slots, cu, kv_lens = [], [], [0], []
    page_indices = np.zeros((num_seqs_padded, pages_per_seq), np.int32)
    for s, (pages, start, num_new) in enumerate(chunks):
        for pos in range(start, start + num_new):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        cu.append(cu[-1] + num_new)
        kv_lens.append(start + num_new)
        page_indices[s, :len(pages)] = pages
    pad_t = num_tokens_padded - len(positions)
    pad_s = num_seqs_padded - len(chunks)
    num_decodes = sum(1 for _, start, n in chunks if n == 1 and start > 0)

    def i32(x):
        return jnp.asarray(x, jnp.int32)

    return AttentionMetadata(
        positions=i32(positions + [0] * pad_t), slot_mapping=i32(slots + [0] * pad_t),
        cu_q_lens=i32(cu + [cu[-1]] * pad_s), kv_lens=i32(kv_lens + [0] * pad_s),
        page_indices=i32(page_indices), num_seqs=i32(len(chunks)), num_decodes=i32(num_decodes))
