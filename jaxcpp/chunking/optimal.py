"""The `optimal` policy: plan every chunk of a prompt at admission to minimise predicted TTFT.

Objective: the flow-shop makespan Σ t_i + (P − 1)·max t_i (`makespan.py`; the exact recurrence for
uneven stages). Since Σ a·(2·L_i·x_i + x_i²) = a·N² whatever the cut, chunking only moves the per-chunk
overhead K·c, the prefix rebuild γ·Σ L_i and the bubble (P − 1)·max t_i. So the search is
one-dimensional over a cap τ on chunk latency:

1. candidates, as rows of one zero-padded matrix: every fixed-chunk plan over the allowed sizes (so the
   result is never worse than any fixed chunk under the model), the equal-latency plan, and for a grid
   of τ (log-spaced, every first-chunk latency t(start, s), every fixed plan's slowest chunk) two fills
   that keep every chunk at t ≤ τ: front-first (the fewest chunks) and back-first (every prefix L_i as
   short as it can be, so the least γ·Σ L_i for that count);
2. score every row at once and keep the best; ties go to the earlier row, i.e. the fixed budget first.
   With a fit error (`margin`), fixed chunks predicted within it of the best are taken instead: the
   middle one of them by size.
   With prompts waiting for this one the score adds the time the plan holds the busiest stage once for
   each of them (`score`): fewer, larger chunks, which cost more makespan but less work.

Chunks are allowed sizes (buckets or alignment multiples in [min chunk, budget]); the last chunk is the
remainder and may be any size up to the budget. Coefficients are taken as non-negative, as calibration
installs them. On small prompts the result is within 1% of an exhaustive search (tests/chunking).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import chunk_times, makespan, stream_period
from jaxcpp.chunking.planner import ChunkSettings, chunk_sizes_between, plan_equal_latency

_GRID_POINTS = 160


def planner_sizes(settings: ChunkSettings) -> np.ndarray:
    """Sizes a chunk before the remainder may take: allowed sizes in [min chunk, budget], and the budget."""
    low = min(max(settings.min_chunk_size, settings.alignment), settings.budget)
    sizes = set(chunk_sizes_between(low, settings.budget, settings))
    sizes.add(settings.budget)  # the fixed chunk is always allowed: it is what the engine would run
    return np.array(sorted(sizes), dtype=np.int64)


def _snap(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Largest size <= each value, 0 where there is none."""
    index = np.searchsorted(sizes, np.floor(np.minimum(values, 2.0**62) + 1e-6), side="right") - 1
    return np.where(index >= 0, sizes[np.maximum(index, 0)], 0)


def _reach_forward(model: LatencyModel, prefix: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Largest real x with t(prefix, x) <= τ (−1 where even x = 0 is over, inf where any x fits)."""
    qb = 2.0 * model.a * prefix + model.b
    slack = tau - model.c - model.gamma * prefix
    disc = np.sqrt(np.maximum(qb * qb + 4.0 * model.a * slack, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.where(qb + disc > 0, 2.0 * slack / (qb + disc), np.inf)
    return np.where(slack < 0, -1.0, root)


def _reach_backward(model: LatencyModel, end: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Largest real s such that every chunk [end − s', end), s' <= s, has t <= τ.

    t(end − s, s) = c + γ·end + (b − γ)·s + a·(2·end·s − s²) <= τ holds for s up to the smaller root of
    a·s² − (2·a·end + b − γ)·s + (τ − c − γ·end) = 0.
    """
    qb = 2.0 * model.a * end + model.b - model.gamma
    slack = tau - model.c - model.gamma * end
    disc = np.sqrt(np.maximum(qb * qb - 4.0 * model.a * slack, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.where((qb > 0) & (qb * qb >= 4.0 * model.a * slack), 2.0 * slack / (qb + disc), np.inf)
    return np.where(slack < 0, -1.0, root)


def _fill(num_rows: int, todo: int, next_chunk: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """[num_rows, K] greedy plans of `todo` tokens, one per row; rows that get stuck are dropped.

    `next_chunk(left, column)` gives every row's next chunk with `left` tokens still to place; a row
    whose chunk comes out <= 0 while tokens are left is stuck.
    """
    left = np.full(num_rows, float(todo))
    alive = np.ones(num_rows, dtype=bool)
    columns: list[np.ndarray] = []
    while True:
        active = alive & (left > 0)
        if not active.any():
            break
        chunk = next_chunk(left, len(columns))
        alive &= ~(active & (chunk <= 0))
        chunk = np.where(active & alive, chunk, 0)
        columns.append(chunk)
        left = left - chunk
    return np.stack(columns, axis=1).astype(np.int64)[alive] if columns else np.zeros((0, 1), np.int64)


def fill_front(model: LatencyModel, prompt_len: int, start: int, sizes: np.ndarray,
               taus: np.ndarray) -> np.ndarray:
    """[len(taus), K] plans: each chunk as large as t <= τ allows; rows of infeasible τ dropped."""

    def next_chunk(left: np.ndarray, column: int) -> np.ndarray:
        reach = _reach_forward(model, prompt_len - left, taus)
        return np.where((left <= reach) & (left <= sizes[-1]), left, _snap(reach, sizes))

    return _fill(len(taus), prompt_len - start, next_chunk)


def fill_back(model: LatencyModel, prompt_len: int, start: int, sizes: np.ndarray,
              taus: np.ndarray) -> np.ndarray:
    """[len(taus), K] plans filled from the end; the leftover first chunk is snapped UP to a size and
    the difference taken from the last chunk (the remainder); rows that cannot be fixed are dropped."""

    def next_chunk(left: np.ndarray, column: int) -> np.ndarray:
        reach = np.minimum(_reach_backward(model, start + left, taus), sizes[-1])
        inner = np.floor(reach + 1e-6) if column == 0 else _snap(reach, sizes)  # the remainder: any size
        return np.where(left <= reach, left, inner)

    backwards = _fill(len(taus), prompt_len - start, next_chunk)
    count = (backwards > 0).sum(axis=1)
    plans = np.zeros_like(backwards)
    for row, (chunks, n) in enumerate(zip(backwards, count, strict=True)):
        plans[row, :n] = chunks[:n][::-1]
    first = plans[:, 0]
    up = sizes[np.minimum(np.searchsorted(sizes, first), len(sizes) - 1)]
    last = plans[np.arange(len(plans)), count - 1]
    shift = up - first
    ok = (count == 1) | ((up >= first) & (last > shift))
    multi = count > 1
    plans[multi, 0] = up[multi]
    plans[np.arange(len(plans))[multi], count[multi] - 1] -= shift[multi]
    return plans[ok]


def fixed_plans(prompt_len: int, start: int, sizes: np.ndarray) -> np.ndarray:
    """[len(sizes), K] fixed-chunk plans, largest size first."""
    todo = prompt_len - start
    sizes = sizes[::-1]
    width = int(-(-todo // sizes[-1]))
    done_before = np.arange(width)[None, :] * sizes[:, None]
    return np.clip(todo - done_before, 0, sizes[:, None]).astype(np.int64)


def score(model: LatencyModel, plans: np.ndarray, settings: ChunkSettings, start: int = 0,
          queued: int = 0, sustained: bool = False) -> np.ndarray:
    """Predicted makespan of each row of a zero-padded plan matrix, plus the time the plan holds the
    slowest stage once for each of `queued` prompts that wait for it (they start only after it: a plan
    of many small chunks finishes its own prompt sooner but delays every one behind).

    `sustained`: prompts keep arriving while others prefill (`jaxcpp.chunking.load`), so the plan is one of
    a stream: the time it holds the busiest stage is its period in a stream of prompts cut alike
    (`makespan.stream_period`), which also counts how long its slow last chunks keep the next prompt's
    first chunks out of the pipe."""
    times = chunk_times(model, plans, start)
    weights = settings.stage_weights
    if sustained:
        held = stream_period(times, settings.pipeline_parallel_size, weights, settings.max_prompt_steps_in_flight)
    else:
        held = times.sum(axis=1) * max(weights or (1.0,))
    return makespan(times, settings.pipeline_parallel_size, weights) + queued * held


def plan_optimal(model: LatencyModel, prompt_len: int, settings: ChunkSettings, start: int = 0,
                 queued: int = 0, sustained: bool = False, margin: float = 0.0) -> list[int]:
    """The chunk plan for tokens start..prompt_len that minimises the predicted makespan (with `queued`
    prompts waiting for it, under `sustained` load or not: see `score`).

    `margin`: how far the model is trusted, as a share of a prediction (the installed fit's error, in
    [0, 1)). Fixed chunks predicted within that share of the best plan are ones the model cannot tell
    from it: if there are any, the middle one of them is taken (the upper middle, by size), else the best
    plan. A fit that misses its own samples by 4% cannot tell plans 3% apart, and on real compute such
    fits erred towards small chunks as often as towards large ones (docs/dynamic_chunking.md), so the
    middle of the sizes it cannot rank is the choice that errs least either way. 0 trusts the model
    fully: the best plan, ties to the fixed budget first."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    todo = prompt_len - start
    sizes = planner_sizes(settings)
    if todo <= 0:
        return []
    if todo <= sizes[0]:
        return [todo]
    fixed = fixed_plans(prompt_len, start, sizes)
    equal = np.array([plan_equal_latency(prompt_len, settings, model, start)], dtype=np.int64)
    fixed_times = chunk_times(model, fixed, start)
    tau_lo = float(model.predict(float(start), float(sizes[0])))
    tau_hi = max(float(fixed_times.max()), tau_lo)
    taus = np.unique(np.concatenate([
        np.geomspace(tau_lo, tau_hi, _GRID_POINTS) if tau_lo > 0 else np.linspace(0, tau_hi, _GRID_POINTS),
        np.asarray(model.predict(float(start), sizes.astype(np.float64))),
        fixed_times.max(axis=1),
    ]))
    planned = [equal, fill_front(model, prompt_len, start, sizes, taus),
               fill_back(model, prompt_len, start, sizes, taus)]
    # Scored group by group: a group's width is its longest plan, so no group pays for another's.
    fixed_scores = score(model, fixed, settings, start, queued, sustained)
    planned_score, best_planned = min(
        ((float(s.min()), group[int(np.argmin(s))]) for group in planned if len(group)
         for s in [score(model, group, settings, start, queued, sustained)]), key=lambda item: item[0])
    best_score = min(planned_score, float(fixed_scores.min()))
    trusted = np.flatnonzero(fixed_scores <= best_score / (1.0 - margin))  # fixed plans come largest first
    best = fixed[trusted[(len(trusted) - 1) // 2]] if len(trusted) else best_planned
    return [int(v) for v in best if v > 0]
