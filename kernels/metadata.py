"""Attention metadata for one ragged step: the data that says which tokens belong to which sequence.

Everything here is *data*, not shape: a new mix of decodes and prefill chunks changes values only, so it
never triggers a compile. Shapes are only the padded token count T, the padded sequence count S and the
pages per sequence P (fixed by the max model length).

Layout conventions (shared by the model, the kernels and the step-input builder):
- Sequences are ordered decodes first (one query token each), then prefill chunks.
- Padding tokens write their K/V into page 0, which the page allocator never hands out, and padding
  sequences have a query length and KV length of 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax


class AttentionMetadata(NamedTuple):
    positions: jax.Array     # [T] int32: absolute position of each token in its sequence (padding: 0)
    slot_mapping: jax.Array  # [T] int32: flat KV slot (page * page_size + offset) each new token writes
    cu_q_lens: jax.Array     # [S + 1] int32: token offsets of each sequence's queries; padding repeats the end
    kv_lens: jax.Array       # [S] int32: cached prefix + new tokens of each sequence (padding: 0)
    page_indices: jax.Array  # [S, P] int32: the pages holding each sequence's KV, in order (unused: 0)
    num_seqs: jax.Array      # [] int32: real sequences in the batch
    num_decodes: jax.Array   # [] int32: sequences [0, num_decodes) are decodes with one query token


# An attention op: (q [T, H, Dh], k_pages, v_pages [num_pages, page_size, Hkv, Dh], metadata
# [, kv_scales [2] float32: the K and V scale of fp8 pages, which the op dequantizes on read]) -> [T, H, Dh].
AttentionFn = Callable[..., jax.Array]
