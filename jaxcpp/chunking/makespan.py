"""Predicted time to first token of a chunk plan: the makespan of a P-stage flow shop.

Chunk i goes through every stage in order, each stage takes chunks in order. With identical stages
that each take t_i for chunk i, the makespan is exactly Σ t_i + (P − 1)·max t_i: the longest monotone
path through the chunk × stage grid visits every chunk once and lingers P − 1 stages on the slowest.
With uneven stages (stage j takes w_j·t_i) there is no closed form, so the recurrence
C[i][j] = max(C[i−1][j], C[i][j−1]) + w_j·t_i is run, vectorised over chunks as a running maximum.

Plans are scored many at a time: rows of a matrix, shorter plans padded with zero-time chunks
(a zero-time chunk after the last one changes neither form).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel


def chunk_times(model: LatencyModel, chunks: Sequence[int], start: int = 0) -> np.ndarray:
    """Predicted latency of each chunk of a plan, chunk i starting after start + Σ_{k<i} x_k tokens."""
    x = np.asarray(chunks, dtype=np.float64)
    prefix = start + np.concatenate([[0.0], np.cumsum(x)[:-1]]) if len(x) else x
    return np.asarray(model.predict(prefix, x), dtype=np.float64)


def plans_time_matrix(model: LatencyModel, plans: Sequence[Sequence[int]], start: int = 0) -> np.ndarray:
    """[num_plans, longest plan] chunk times, zero-padded."""
    width = max((len(p) for p in plans), default=0)
    times = np.zeros((len(plans), max(width, 1)))
    for row, plan in enumerate(plans):
        times[row, :len(plan)] = chunk_times(model, plan, start)
    return times


def makespan(times: np.ndarray, pipeline_parallel_size: int,
             stage_weights: Sequence[float] | None = None) -> np.ndarray:
    """Flow-shop makespan of each row of `times` ([num_plans, num_chunks], zero-padded)."""
    times = np.atleast_2d(np.asarray(times, dtype=np.float64))
    if stage_weights is None:
        return times.sum(axis=1) + (pipeline_parallel_size - 1) * times.max(axis=1)
    if len(stage_weights) != pipeline_parallel_size:
        raise ValueError(f"{len(stage_weights)} stage weights for {pipeline_parallel_size} stages")
    done = np.zeros_like(times)  # completion of each chunk on the previous stage (stage -1: at 0)
    for weight in stage_weights:
        stage = weight * times
        finish_if_never_waiting = np.cumsum(stage, axis=1)
        # C[i] = S_i + max_{k<=i} (C_prev[k] − S_{k−1}): the last wait for the previous stage decides.
        slack = done - (finish_if_never_waiting - stage)
        done = finish_if_never_waiting + np.maximum.accumulate(slack, axis=1)
    return done[:, -1]


def predicted_ttft(model: LatencyModel, chunks: Sequence[int], pipeline_parallel_size: int,
                   stage_weights: Sequence[float] | None = None, start: int = 0) -> float:
    """Predicted time from the first chunk entering stage 0 to the last leaving the last stage."""
    if not chunks:
        return 0.0
    times = chunk_times(model, chunks, start)[None, :]
    return float(makespan(times, pipeline_parallel_size, stage_weights)[0])
