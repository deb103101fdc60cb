"""The `optimal` policy: plan every chunk of a prompt at admission to minimise predicted TTFT.

Objective: the flow-shop makespan Σ t_i + (P − 1)·max t_i (`makespan.py`; the exact recurrence for
uneven stages). Since Σ a·(2·L_i·x_i + x_i²) = a·N² whatever the cut, chunking only moves the per-chunk
overhead K·c, the prefix rebuild γ·Σ L_i and the bubble (P − 1)·max t_i. For a cap τ on chunk latency,
filling each chunk as far as t ≤ τ allows gives the fewest chunks under that cap, so the search is
one-dimensional over τ:

1. candidates: every fixed-chunk plan over the allowed sizes (so the result is never worse than any
   fixed chunk under the model), the equal-latency plans, and greedy τ-fills for a dense grid of τ
   (log-spaced, plus every first-chunk latency t(start, s), plus every fixed plan's slowest chunk);
2. score them all at once as a matrix and refine τ once around the best greedy fill;
3. keep the best; ties go to the earlier candidate, i.e. the fixed budget first.

Chunks are allowed sizes (buckets or alignment multiples in [min chunk, budget]); the last chunk is the
remainder and may be any size up to the budget.
"""

from __future__ import annotations

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import makespan, plans_time_matrix
from jaxcpp.chunking.planner import ChunkSettings, chunk_sizes_between, plan_chunks, plan_fixed

_GRID_POINTS = 192
_REFINE_POINTS = 64


def planner_sizes(settings: ChunkSettings) -> np.ndarray:
    """Chunk sizes a plan may use before its remainder: allowed sizes in [min chunk, budget], and the budget."""
    low = min(max(settings.min_chunk_size, settings.alignment), settings.budget)
    sizes = set(chunk_sizes_between(low, settings.budget, settings))
    sizes.add(settings.budget)  # the fixed chunk is always allowed: it is what the engine would run
    return np.array(sorted(sizes), dtype=np.int64)


def largest_chunk_within(model: LatencyModel, prefix: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Real x with t(L, x) = τ, elementwise (−inf where even x = 0 is over τ)."""
    qa, qb = model.a, 2.0 * model.a * prefix + model.b
    qc = model.c + model.gamma * prefix - tau
    with np.errstate(invalid="ignore", divide="ignore"):
        if qa > 0.0:
            disc = np.sqrt(np.maximum(qb * qb - 4.0 * qa * qc, 0.0))
            root = np.where(qb > 0, -2.0 * qc / (qb + disc), (-qb + disc) / (2.0 * qa))
        else:
            root = np.where(qb > 0, -qc / qb, np.where(qc <= 0, np.inf, -np.inf))
    return np.where(qc <= 0.0, root, -np.inf)


def greedy_fills(model: LatencyModel, prompt_len: int, start: int, sizes: np.ndarray,
                 taus: np.ndarray) -> list[list[int]]:
    """For each τ, chunks as large as t ≤ τ allows (snapped down to `sizes`); infeasible τ are dropped."""
    num = len(taus)
    prefix = np.full(num, float(start))
    alive = np.ones(num, dtype=bool)
    columns: list[np.ndarray] = []
    largest = int(sizes[-1])
    while True:
        remaining = prompt_len - prefix
        active = alive & (remaining > 0)
        if not active.any():
            break
        reach = largest_chunk_within(model, prefix, taus)
        index = np.searchsorted(sizes, np.floor(reach), side="right") - 1
        chunk = np.where(index >= 0, sizes[np.maximum(index, 0)], 0)
        finish = (remaining <= reach) & (remaining <= largest)
        chunk = np.where(finish, remaining, chunk)
        alive &= ~(active & (chunk <= 0))
        chunk = np.where(active & alive, chunk, 0)
        columns.append(chunk)
        prefix = prefix + chunk
    if not columns:
        return []
    table = np.stack(columns, axis=1).astype(np.int64)
    return [[int(x) for x in row if x > 0] for row in table[alive]]


def backward_fills(model: LatencyModel, prompt_len: int, start: int, sizes: np.ndarray,
                   taus: np.ndarray) -> list[list[int]]:
    """For each τ, chunks filled from the END as far as t ≤ τ allows, so the prefix grows as late as it can.

    Under one τ this makes every prefix L_i as short as it can be, which minimises the γ·Σ L_i rebuild for
    the fewest chunks; the leftover lands on the first chunk, snapped up to an allowed size, with the
    difference taken from the last chunk (the remainder, which may be any size).
    """
    num = len(taus)
    end = np.full(num, float(prompt_len))
    alive = np.ones(num, dtype=bool)
    columns: list[np.ndarray] = []
    size_f = sizes.astype(np.float64)[None, :]
    while True:
        left = end - start
        active = alive & (left > 0)
        if not active.any():
            break
        begin = end[:, None] - size_f
        fits = (model.predict(np.maximum(begin, start), size_f) <= taus[:, None]) & (begin >= start)
        best = np.where(fits.any(axis=1), sizes[np.argmax(np.where(fits, size_f, -1.0), axis=1)], 0)
        last_fit = left <= sizes[-1]
        first = np.asarray(model.predict(float(start), np.maximum(left, 0.0))) <= taus
        # The whole leftover fits as the first chunk: stop here and snap it up later.
        chunk = np.where(last_fit & first & (best < left), left, best)
        alive &= ~(active & (chunk <= 0))
        chunk = np.where(active & alive, chunk, 0)
        columns.append(chunk)
        end = end - chunk
    plans: list[list[int]] = []
    for row in np.stack(columns, axis=1)[alive] if columns else []:
        plan = [int(x) for x in row[::-1] if x > 0]
        up = sizes[np.searchsorted(sizes, plan[0])] if plan[0] <= sizes[-1] else None
        if len(plan) > 1 and up is not None and plan[-1] > up - plan[0]:
            plan[-1] -= int(up) - plan[0]
            plan[0] = int(up)
        if len(plan) == 1 or all(x in set(sizes.tolist()) for x in plan[:-1]):
            plans.append(plan)
    return plans


def _best(model: LatencyModel, plans: list[list[int]], settings: ChunkSettings,
          start: int) -> tuple[int, np.ndarray]:
    scores = makespan(plans_time_matrix(model, plans, start), settings.pipeline_parallel_size,
                      settings.stage_weights)
    return int(np.argmin(scores)), scores


def plan_optimal(model: LatencyModel, prompt_len: int, settings: ChunkSettings, start: int = 0) -> list[int]:
    """The chunk plan for tokens start..prompt_len that minimises the predicted makespan."""
    todo = prompt_len - start
    if todo <= 0:
        return []
    sizes = planner_sizes(settings)
    fixed = [plan_fixed(prompt_len, int(s), start) for s in sizes[::-1]]
    if todo <= sizes[0]:
        return [todo]
    equal = [plan_chunks("equal-latency", prompt_len, settings, model, start)]
    fixed_times = plans_time_matrix(model, fixed, start)
    tau_lo = float(model.predict(float(start), float(sizes[0])))
    tau_hi = float(fixed_times.max())
    taus = np.concatenate([
        np.geomspace(max(tau_lo, 1e-300), max(tau_hi, tau_lo, 1e-300), _GRID_POINTS),
        np.asarray(model.predict(float(start), sizes.astype(np.float64))),
        fixed_times.max(axis=1),
    ])
    taus = np.unique(taus)
    greedy = (greedy_fills(model, prompt_len, start, sizes, taus)
              + backward_fills(model, prompt_len, start, sizes, taus))
    plans = fixed + equal + greedy
    best, _ = _best(model, plans, settings, start)
    if best >= len(fixed) + len(equal):
        # Refine τ between the grid neighbours of the winning greedy fill.
        tau = float(plans_time_matrix(model, [plans[best]], start).max())
        finer = np.linspace(tau * 0.97, tau * 1.03, _REFINE_POINTS)
        plans = [plans[best]] + greedy_fills(model, prompt_len, start, sizes, finer)
        best, _ = _best(model, plans, settings, start)
    return plans[best]
