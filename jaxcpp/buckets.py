"""Shape buckets: the bounded set of padded batch shapes that XLA compiles, all at start-up (no jax).

Token counts are padded up to a ladder of multiples of `alignment = max(64, page_size)`; the spacing
doubles every time the size doubles (at most 8 rungs per octave) so padding waste stays under ~12.5%
past the first octaves while the number of programs grows only logarithmically. The sequence count of
a step is padded to `min(token bucket, max_num_seqs)`, so there is exactly one program per token bucket.
"""

from __future__ import annotations

import bisect


def token_alignment(page_size: int) -> int:
    return max(64, page_size)


def token_buckets(max_num_batched_tokens: int, page_size: int) -> list[int]:
    align = token_alignment(page_size)
    top = -(-max_num_batched_tokens // align) * align
    buckets, size = [], align
    while size < top:
        buckets.append(size)
        step = max(align, (1 << (size.bit_length() - 1)) // 8 // align * align)
        size += step
    buckets.append(top)
    return buckets


def pad_to_bucket(n: int, buckets: list[int]) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def seq_bucket(token_bucket: int, max_num_seqs: int) -> int:
    return min(token_bucket, max_num_seqs)


def padding_share(step_tokens: list[int], buckets: list[int]) -> float:
    """The share of padding in the tokens a run's steps computed: sum(bucket - n) / sum(bucket).

    `step_tokens` are the real token counts of the steps (the schedule does not depend on the ladder,
    so one recorded run prices any ladder)."""
    if not step_tokens:
        raise ValueError("step_tokens is empty: no steps to price")
    padded = sum(pad_to_bucket(n, buckets) for n in step_tokens)
    return (padded - sum(step_tokens)) / padded
