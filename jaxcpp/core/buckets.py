"""Shape buckets: the bounded set of padded batch shapes that XLA compiles, all at start-up (no jax).

Token counts are padded up to a ladder of multiples of `alignment = max(64, page_size)`; the spacing
doubles every time the size doubles (at most 8 rungs per octave) so padding waste stays under ~12.5%
past the first octaves while the number of programs grows only logarithmically. The sequence count of
a step is padded to `min(token bucket, max_num_seqs)`, so there is exactly one program per token bucket.

A step of few tokens may also take a short ladder below the alignment, `DECODE_LADDER`
(`decode_buckets`), made for decode-only steps: once the prompts are in, a step of a few decodes would
otherwise compute 64 rows for each token. A step with prompt chunks takes it too (a lone short prompt's
prefill computed 64 rows for its 32 tokens: the TTFT of a short prompt at concurrency 1), unless it
scores prompt tokens (`prompt_logprobs`): that program works in blocks of 64 rows and exists only for
the token buckets. Dynamic chunking still snaps chunk sizes to the token buckets.

The sampler, one program for every bucket, takes max_num_seqs rows of logits; its plain program (no
penalty history, no grammar mask: what nearly every step runs) draws only the first `sampler_rows` of
them, the step's sequences rounded up to a power of two (`sampler_row_rungs`, one program each): a
draw's noise costs a vocabulary of random numbers a row, so a lone stream drawing 64 rows paid for 63
that nobody reads (docs/benchmarks.md, "A lone stream").
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Rungs below the alignment, for steps of few tokens (decodes, a short prompt); chosen from the mixed
# workload's padding share and the cold start each program costs (docs/benchmarks.md, "Decode-only buckets").
DECODE_LADDER = (8, 16, 32)


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


def decode_buckets(max_num_seqs: int, page_size: int) -> list[int]:
    """The rungs of `DECODE_LADDER` below the alignment, up to the first that holds `max_num_seqs`
    decodes (no decode-only step is larger)."""
    rungs: list[int] = []
    for rung in DECODE_LADDER:
        if rung >= token_alignment(page_size) or (rungs and rungs[-1] >= max_num_seqs):
            break
        rungs.append(rung)
    return rungs


def step_bucket(num_tokens: int, on_rungs: bool, buckets: list[int], decode_rungs: Sequence[int] = ()) -> int:
    """The token bucket a step runs in: the smallest that holds it, a rung below the buckets only if
    `on_rungs` (the step scores no prompt token: `SchedulerOutput.fits_rungs`)."""
    return pad_to_bucket(num_tokens, [*decode_rungs, *buckets] if on_rungs else buckets)


def pad_to_bucket(n: int, buckets: list[int]) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def seq_bucket(token_bucket: int, max_num_seqs: int) -> int:
    return min(token_bucket, max_num_seqs)


def sampler_row_rungs(max_num_seqs: int) -> list[int]:
    """The row counts the plain sampler program is compiled for: powers of two below max_num_seqs, then it."""
    return [1 << i for i in range((max_num_seqs - 1).bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]


def sampler_programs(max_num_seqs: int) -> list[tuple[bool, bool, int]]:
    """Every sampler program a last stage compiles, as (with the penalty history, with a grammar mask, rows):
    those with a history or a mask on all rows, the plain one on each row rung."""
    full = [(True, False), (False, True), (True, True)]
    return [(h, m, max_num_seqs) for h, m in full] + [(False, False, r) for r in sampler_row_rungs(max_num_seqs)]


def sampler_rows(num_seqs: int | None, max_num_seqs: int) -> int:
    """The rows the plain sampler draws for a step of `num_seqs` sequences: the smallest rung that holds
    them (None, a step that did not say: all): the next power of two, at most max_num_seqs. Computed, not
    looked up, as it runs every step."""
    return max_num_seqs if num_seqs is None else min(1 << (max(num_seqs, 1) - 1).bit_length(), max_num_seqs)


def padding_share(step_tokens: list[int], buckets: list[int], *, on_rungs: Sequence[bool] = (),
                  decode_rungs: Sequence[int] = ()) -> float:
    """The share of padding in the tokens a run's steps computed: sum(bucket - n) / sum(bucket).

    `step_tokens` are the real token counts of the steps and `on_rungs` which of them may take a rung
    (`step_bucket`; the schedule does not depend on the ladder, so one recorded run prices any ladder)."""
    if not step_tokens:
        raise ValueError("step_tokens is empty: no steps to price")
    flags = list(on_rungs) or [False] * len(step_tokens)
    padded = sum(step_bucket(n, d, buckets, decode_rungs) for n, d in zip(step_tokens, flags, strict=True))
    return (padded - sum(step_tokens)) / padded


def bucket_progress(i: int, of: int, num_tokens: int, seconds: float, programs: int = 0, from_cache: int = 0,
                    where: str = "") -> str:
    """The warm-up's line for bucket `i` of `of` (`where`: e.g. " on 2 stage(s)"): "compiled", or "loaded ...
    from the compilation cache" when the persistent cache held every program the bucket needs (`programs`
    looked up there, `from_cache` found)."""
    if programs and from_cache == programs:
        return f"loaded bucket {i}/{of}{where} from the compilation cache: {num_tokens} tokens ({seconds:.1f}s)"
    cached = f" ({from_cache} of {programs} programs from the compilation cache)" if from_cache else ""
    return f"compiled bucket {i}/{of}{where}{cached}: {num_tokens} tokens ({seconds:.1f}s)"
