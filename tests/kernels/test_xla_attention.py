"""The XLA (CPU) attention path against the reference: every layout the metadata contract allows.

`ragged_paged_attention_xla` splits a batch into decodes (per-token page gathers) and prefill tokens
(query blocks that gather each touched sequence's pages once), so the mixes below aim at the seams:
decodes next to prefill tokens in one block, many short prefills in one block, a chunk straddling blocks,
padding tokens, empty and long cached prefixes. Every mix of one configuration has the same shapes, so a
new mix must compile nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels.ragged_paged_attention import (
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)

NUM_TOKENS, NUM_SEQS, MAX_KV_LEN, NUM_KV_HEADS, HEAD_DIM = 128, 24, 768, 2, 32
# name -> (new tokens per sequence, cached prefix per sequence); decodes first, as the layout says.
MIXES = {
    "decode_only": ([1] * 10, [0, 5, 15, 16, 63, 64, 150, 299, 700, 1]),
    "prefill_only": ([37, 19, 5, 40], [0, 250, 21, 700]),
    "mixed": ([1, 1, 1, 29, 23, 50], [0, 77, 290, 0, 180, 3]),
    "short_prefills_one_block": ([1, 1] + [3] * 14 + [2, 5], [9, 400] + list(range(0, 700, 50)) + [0, 31]),
    "chunk_straddles_blocks": ([1, 1, 1, 7, 100], [12, 0, 500, 60, 640]),  # 100 tokens from token 10
    "one_long_chunk": ([128], [600]),  # every token real, no padding
    "all_padding": ([], []),
}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_batch(mix: str, *, page_size: int, group: int, dtype, seed: int = 0):
    return ragged_batch(*MIXES[mix], num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, max_kv_len=MAX_KV_LEN,
                        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=page_size, group=group,
                        dtype=dtype, seed=seed)


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check_against_reference(*, page_size, group, dtype, **kw):
    xla = jax.jit(functools.partial(ragged_paged_attention_xla, **kw))
    reference = jax.jit(ragged_paged_attention_reference)
    for mix in MIXES:
        q, k_pages, v_pages, md = make_batch(mix, page_size=page_size, group=group, dtype=dtype)
        out = xla(q, k_pages, v_pages, md)
        assert out.shape == q.shape and out.dtype == q.dtype
        err = max_error(out, reference(q, k_pages, v_pages, md))
        assert err <= TOLERANCE[dtype], f"{mix}: max error {err}"
        num_real = int(md.cu_q_lens[int(md.num_seqs)])
        assert not np.asarray(out[num_real:], np.float32).any(), f"{mix}: padding tokens must be 0"
    assert xla._cache_size() == 1


@pytest.mark.parametrize("block_q", [16, 64])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [16, 64])
def test_matches_reference_fp32(page_size, group, block_q):
    check_against_reference(page_size=page_size, group=group, dtype=jnp.float32, block_q=block_q)


@pytest.mark.parametrize("group_blocks", [1, 3, 100])
def test_query_blocks_in_groups_of_any_size(group_blocks):
    """Groups of query blocks each visit KV only as far as their own last query sees (8 blocks here:
    groups of 1, of 3 with a short last group, and one group of all)."""
    check_against_reference(page_size=16, group=4, dtype=jnp.float32, block_q=16, group_blocks=group_blocks)


def test_matches_reference_bf16():
    check_against_reference(page_size=16, group=4, dtype=jnp.bfloat16, block_q=32)


def test_kv_block_smaller_than_a_page_and_odd_block_q():
    check_against_reference(page_size=64, group=4, dtype=jnp.float32, block_q=24, kv_block_tokens=16)


def test_sm_scale_and_a_pool_larger_than_the_table():
    """The model passes every layer's pages as one pool with offset page ids: any num_pages works."""
    q, k_pages, v_pages, md = make_batch("mixed", page_size=16, group=4, dtype=jnp.float32)
    offset = k_pages.shape[0]
    k_pool, v_pool = jnp.concatenate([k_pages[::-1], k_pages]), jnp.concatenate([v_pages[::-1], v_pages])
    md = md._replace(page_indices=md.page_indices + offset)
    out = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.3))(q, k_pool, v_pool, md)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.3))(q, k_pool, v_pool, md)
    assert max_error(out, ref) <= TOLERANCE[jnp.float32]


def test_a_new_mix_compiles_nothing():
    f = jax.jit(ragged_paged_attention_xla)
    for mix in ("decode_only", "prefill_only", "mixed", "all_padding"):
        f(*make_batch(mix, page_size=16, group=4, dtype=jnp.float32)).block_until_ready()
        assert f._cache_size() == 1, mix
