"""Predicted time to first token of a chunk plan: the makespan of a P-stage flow shop.

Chunk i goes through every stage in order, each stage takes chunks in order. With identical stages
that each take t_i for chunk i, the makespan is exactly Σ t_i + (P − 1)·max t_i: the longest monotone
path through the chunk × stage grid visits every chunk once and lingers P − 1 stages on the slowest.
With uneven stages (stage j takes w_j·t_i) there is no closed form, so the recurrence
C[i][j] = max(C[i−1][j], C[i][j−1]) + w_j·t_i is run, vectorised over chunks as a running maximum.

Plans are scored many at a time: rows of a matrix, shorter plans padded with zero-time chunks
(a zero-time chunk after the last one changes neither form).

`stream_period` is a plan's cost as throughput rather than latency: how long the busiest stage is taken
per prompt when prompts cut alike follow each other, with the engine's bound on steps in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxcpp.chunking.latency_model import LatencyModel


def chunk_times(model: LatencyModel, chunks: Sequence[int] | np.ndarray, start: int = 0) -> np.ndarray:
    """Predicted latency of each chunk, chunk i starting after start + Σ_{k<i} x_k tokens.

    `chunks` is one plan or a zero-padded matrix of plans (one per row); padding chunks take no time.
    """
    x = np.asarray(chunks, dtype=np.float64)
    prefix = start + np.cumsum(x, axis=-1) - x
    return np.where(x > 0, model.predict(prefix, x), 0.0)


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


def stream_period(times: np.ndarray, pipeline_parallel_size: int, stage_weights: Sequence[float] | None = None,
                  max_in_flight: int | None = None) -> np.ndarray:
    """Time per prompt on the busiest stage, for each row of `times`, in a stream of prompts cut alike.

    The row's chunks run twice in a row through the flow shop; the second copy's span on each stage is
    its own work there plus any wait, and the longest span is returned. With at most `max_in_flight`
    steps in flight (a slot frees when its step leaves the last stage; `jaxcpp.core.in_flight`), a prompt
    whose last chunks are slow still fills the pipe when the next prompt's first, fast chunks come, and
    stage 0 waits for slots: fixed 32K chunks of 256K prompts on PP 2 (docs/benchmarks.md's model) take
    46.8 s a prompt so, not their 43.7 s of work.
    """
    times = np.atleast_2d(np.asarray(times, dtype=np.float64))
    weights = np.asarray(stage_weights or (1.0,) * pipeline_parallel_size)
    rows = np.arange(len(times))
    count = (times > 0).sum(axis=1)
    both = np.concatenate([times, times], axis=1)  # each copy's padding moved to the row's end
    both = np.take_along_axis(both, np.argsort(both == 0, axis=1, kind="stable"), axis=1)
    done = np.zeros((len(times), both.shape[1], len(weights)))  # when chunk i leaves each stage
    free = np.zeros((len(times), len(weights)))                 # when each stage is done with its latest
    for i in range(both.shape[1]):
        t = both[:, i]
        # Its slot: the step max_in_flight before it must have left the last stage.
        ready = done[:, i - max_in_flight, -1] if max_in_flight and i >= max_in_flight else 0.0
        for stage, weight in enumerate(weights):
            free[:, stage] = np.where(t > 0, np.maximum(free[:, stage], ready) + weight * t, free[:, stage])
            ready = free[:, stage]
        done[:, i] = free
    spans = done[rows, 2 * count - 1] - done[rows, count - 1]
    return spans.max(axis=1)


def predicted_ttft(model: LatencyModel, chunks: Sequence[int], pipeline_parallel_size: int,
                   stage_weights: Sequence[float] | None = None, start: int = 0) -> float:
    """Predicted time from the first chunk entering stage 0 to the last leaving the last stage."""
    if not chunks:
        return 0.0
    times = chunk_times(model, chunks, start)[None, :]
    return float(makespan(times, pipeline_parallel_size, stage_weights)[0])
