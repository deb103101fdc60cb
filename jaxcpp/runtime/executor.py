"""The narrow interface between the engine loop and whatever runs the model.

    ticket = executor.submit(step_input)      # dispatch; never blocks on the device
    result = executor.collect(ticket)         # the sampled tokens, in submission (FIFO) order

At most `max_in_flight` tickets may be outstanding (the pipeline depth P). The single-device executor
here is depth 1; the pipeline executor (`jaxcpp.runtime.pipeline`) keeps up to P micro-batches in
flight, and a multi-process executor can slot in beside them without touching the scheduler.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jaxcpp.runtime.model_runner import ModelRunner, StepOutput
from jaxcpp.step_input import StepInput


@dataclass
class StepResult:
    """A collected step. `tokens` is fetched on first read, so collecting a step whose tokens nobody
    reads (only middle prefill chunks) never waits for the device."""

    _tokens: Any         # [S] int32, host or still on the device
    _logits: Any         # [S, V] float32, left on the device until asked for

    @property
    def tokens(self) -> np.ndarray:  # [S] int32, host
        if not isinstance(self._tokens, np.ndarray):
            self._tokens = np.asarray(self._tokens)
        return self._tokens

    def logits(self) -> np.ndarray:
        return np.asarray(self._logits)


class Executor(Protocol):
    max_in_flight: int

    def warmup(self, token_buckets: list[int], max_num_seqs: int, pages_per_seq: int) -> float: ...

    def submit(self, step: StepInput, wait_for_last_stage: bool = False) -> int: ...

    def collect(self, ticket: int) -> StepResult: ...

    def forward_time(self, ticket: int) -> float | None:
        """The slowest stage's model-call time for a collected step, once probes know it."""
        ...

    def time_dummy_forward(self, num_tokens: int) -> float:
        """An attention-free forward of one bucket, timed around the model call (calibration sweep)."""
        ...


class SingleDeviceExecutor:
    """The whole model on one device; JAX's async dispatch lets the host prepare while it runs."""

    max_in_flight = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pending: deque[tuple[int, StepOutput]] = deque()
        self._next_ticket = 0

    def warmup(self, token_buckets: list[int], max_num_seqs: int, pages_per_seq: int) -> float:
        return self.runner.warmup(token_buckets, max_num_seqs, pages_per_seq)

    def submit(self, step: StepInput, wait_for_last_stage: bool = False) -> int:
        assert len(self._pending) < self.max_in_flight, "collect before submitting more"
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._pending.append((ticket, self.runner.execute(step)))
        return ticket

    def collect(self, ticket: int) -> StepResult:
        head, out = self._pending.popleft()
        assert head == ticket, f"tickets are collected in FIFO order: expected {head}, got {ticket}"
        return StepResult(np.asarray(out.tokens), out.logits)

    def forward_time(self, ticket: int) -> float | None:
        return None  # no timing probes without a pipeline: dynamic chunking needs PP > 1

    def time_dummy_forward(self, num_tokens: int) -> float:
        raise NotImplementedError("the calibration sweep runs on pipelines only (dynamic chunking needs PP > 1)")
