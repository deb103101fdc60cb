"""Timing probes for pipeline stages, gathered off the engine loop's thread.

JAX has no device events, so each stage has a watcher thread that takes the stage's micro-batches in
submission (FIFO) order and blocks on them: first on the inputs (the step's metadata and the activations
handed over by the previous stage), then on the output. A stage runs its micro-batches in order, so

    start   = max(inputs ready, dispatched, previous completion on this stage)
    forward = completion - start

is the time of the model call alone: staging the batch and the stage-to-stage transfer end before
`inputs ready`, and queueing behind the previous micro-batch ends at its completion. One thread per
stage (rather than one for the whole pipe) keeps a slow last stage from delaying what the watcher of
stage 0 observes. When every stage of a micro-batch is timed, its timings go to the trace and, if the
batch was submitted with `ack`, the acknowledgement (those timings) is handed to the waiting head.

Accuracy: a watcher that wakes late (the GIL, a busy CPU) sees inputs ready late, which shortens the
forward it records; stage s is also never allowed to start before stage s-1 finished the same batch.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxcpp.core.executor import ExecutorError, StageTiming

log = logging.getLogger(__name__)

MAX_KEPT = 100_000  # timings kept for timings(); older ones are dropped


@dataclass
class DispatchedStage:
    """What a stage's watcher waits on for one micro-batch (the arrays); its result is a StageTiming."""

    step_id: int
    stage: int
    num_tokens_padded: int        # padded token count (the bucket)
    ack: bool                     # the head waits for this batch's acknowledgement (every stage agrees)
    traced: bool                  # False for warm-up batches
    dispatched: float             # perf_counter() when the stage's program was dispatched
    inputs: Any                   # device arrays the program reads (never the donated KV pages)
    output: Any                   # device arrays it produces (the activations, or tokens + logits)


class TimingRecorder:
    """One watcher thread per stage; `on_timing` (e.g. the trace writer) is called from them."""

    def __init__(self, num_stages: int, on_timing: Callable[[StageTiming], None] | None = None) -> None:
        self.num_stages = num_stages
        self._on_timing = on_timing
        self._lock = threading.Lock()
        self._partial: dict[int, list[StageTiming]] = {}
        self._acks: dict[int, threading.Event] = {}
        self._acked: dict[int, tuple[StageTiming, ...]] = {}
        self._errors: dict[int, ExecutorError] = {}
        self._history: deque[StageTiming] = deque(maxlen=MAX_KEPT)
        self._queues: list[queue.SimpleQueue[DispatchedStage | None]] = [
            queue.SimpleQueue() for _ in range(num_stages)]
        self._threads = [threading.Thread(target=self._watch, args=(s,), name=f"jaxcpp-stage{s}-watcher",
                                          daemon=True) for s in range(num_stages)]
        for t in self._threads:
            t.start()
        # A watcher still inside jax when the interpreter finalizes is unwound by force through C++
        # frames that do not allow it, and the process aborts ("FATAL: exception not rethrown") after
        # its work is done: so an owner that never calls close() (a script, `jaxcpp generate`) still
        # has its watchers stopped first. atexit runs before the daemon threads are cut off.
        atexit.register(self.close)

    # ---- the engine loop's side ----------------------------------------------------------------
    def watch(self, stages: list[DispatchedStage]) -> None:
        """Hand one micro-batch's per-stage records to the watchers (never blocks)."""
        if stages[0].ack:
            with self._lock:
                self._acks[stages[0].step_id] = threading.Event()
        for dispatched in stages:
            self._queues[dispatched.stage].put(dispatched)

    def wait_for_ack(self, step_id: int) -> tuple[StageTiming, ...]:
        """Block until every stage has finished (and timed) step `step_id`; its timings, stage order."""
        event = self._acks.get(step_id)
        if event is None:
            raise KeyError(f"step {step_id} was not submitted with ack=True")
        event.wait()
        with self._lock:
            del self._acks[step_id]
            error = self._errors.pop(step_id, None)
            timings = self._acked.pop(step_id, ())
        if error is not None:
            raise error
        return timings

    def timings(self) -> list[StageTiming]:
        with self._lock:
            return list(self._history)

    def close(self) -> None:
        """Stop the watchers once they have timed what was handed to them. Idempotent."""
        atexit.unregister(self.close)
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)

    # ---- the watcher threads -------------------------------------------------------------------
    def _watch(self, stage: int) -> None:
        last_done = 0.0
        while (item := self._queues[stage].get()) is not None:
            try:
                jax.block_until_ready(item.inputs)
                inputs_ready = time.perf_counter()
                jax.block_until_ready(item.output)
                done = time.perf_counter()
            except Exception as e:  # a failed program: the head learns of it when it reads the result
                log.warning("stage %d, micro-batch %d failed: %s", stage, item.step_id, e)
                self._fail(item.step_id, ExecutorError(f"micro-batch {item.step_id} failed: {e}", stage=stage))
                continue
            start = max(inputs_ready, item.dispatched, last_done)
            last_done = done
            self._record(StageTiming(item.step_id, stage, item.num_tokens_padded, item.traced, item.dispatched,
                                     inputs_ready, start, done))

    def _record(self, timing: StageTiming) -> None:
        with self._lock:
            parts = self._partial.setdefault(timing.step_id, [])
            parts.append(timing)
            if len(parts) < self.num_stages:
                return
            del self._partial[timing.step_id]
            parts = _in_stage_order(parts)
            self._history.extend(parts)
            event = self._acks.get(timing.step_id)
            if event is not None:
                self._acked[timing.step_id] = tuple(parts)
                event.set()
        if self._on_timing is not None and timing.traced:
            for t in parts:
                self._on_timing(t)

    def _fail(self, step_id: int, error: ExecutorError) -> None:
        with self._lock:
            self._partial.pop(step_id, None)
            event = self._acks.get(step_id)
            if event is not None:
                self._errors[step_id] = error
                event.set()


def _in_stage_order(parts: list[StageTiming]) -> list[StageTiming]:
    """A stage neither starts nor ends before its predecessor finished the same micro-batch; a watcher
    that woke late may have seen things in another order, so the times are tightened to that order."""
    parts = sorted(parts, key=lambda t: t.stage)
    for i in range(1, len(parts)):
        before = parts[i - 1].done
        parts[i] = dataclasses.replace(parts[i], start=max(parts[i].start, before),
                                       done=max(parts[i].done, before))
    return parts
