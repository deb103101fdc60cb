"""The contract between the engine (host) and whatever runs the model. Host data both ways; no jax.

    seconds = executor.warmup(shape)            # compile every program the engine will use
    executor.submit(StepRequest(step_id, step, want_tokens=True, ...))   # one value, every executor
    result = executor.collect(step_id)          # numpy arrays only
    seconds = executor.time_attention_free_forward(num_tokens)   # the calibration sweep
    executor.num_compilations()                 # programs compiled since the executor was built
    executor.record_host_phases(phases)         # the engine loop's own time, for the trace
    executor.add_failure_listener(callback)     # callback(error): it failed on its own, between steps
    executor.close()

A step has one id from the scheduler to the executor to the trace: the scheduler's `step_id` (>= 0,
increasing). The engine owns the one queue of steps in flight (`jaxcpp.core.in_flight`): how many
(`max_in_flight`, the pipeline depth P, is the executor's depth; the queue's rule adds the step an
async engine submits before it collects the oldest), and that they are collected oldest first, and
only steps in flight are fed back from. An executor keeps what it needs of each step by its id and
checks none of those rules again. Its own steps (warm-up) take ids below zero. What crosses the contract:

    engine -> executor   StepRequest: the StepInput (padded numpy arrays, a few KB), what to bring back,
                         and `feedback_from`: the id of a step still in flight whose sampled tokens this
                         step's placeholder decodes read on the device (`StepInput.feedback_rows`), never
                         through the host
    executor -> engine   StepResult: tokens [S] (unless want_tokens=False: a step of middle prefill
                         chunks samples nothing and is collected without waiting for the device),
                         logits [S, V] when asked at submit, and with `ack` each stage's StageTiming;
                         with want_logprobs each sampled token's log-probability and the top
                         MAX_LOGPROBS [S], with want_prompt_logprobs every token's of its
                         `prompt_targets` entry [T]: computed on the device, only these come home
    engine -> executor   StepRequest.bitmask [max_num_seqs, ceil(V / 32)] int32 for a step with
                         constrained rows (`jaxcpp.structured`): the sampler draws only tokens whose bit
                         is set; None: all. Optional: an executor with `defers_masks = True` also takes
                         `StepRequest(..., defer_sampling=True)` (the forward only) and later
                         `sample(step_id, bitmask)` (the draw), before any other step is submitted

`ack`: collect waits until the last stage has acknowledged the micro-batch, i.e. every stage finished
and timed it (dynamic chunking needs the timing before it sizes the next chunk). A failed stage or
device surfaces as `ExecutorError` from submit or collect; the engine fails the requests it affected.
An executor that can fail on its own (a stage process that dies while the engine idles) also tells
its failure listeners at once; the others never call them.

Disaggregation adds two sub-protocols, each reached only through the engine, on its thread
(`jaxcpp.core.disaggregation`): a producer's `offer_kv` (`KVProducerExecutor`) and a consumer's
`pull_kv` / `kv_arrived` / `import_kv` (`KVConsumerExecutor`). A pull returns at once; the engine asks
`kv_arrived` (never blocking) each step and imports the pages in order with its steps, so no step waits
for a transfer.

Implementations: `jaxcpp.runtime.pipeline.PipelineExecutor` (P stages in this process, P = 1 included),
`jaxcpp.head.mp_executor.MultiProcessExecutor` (one process per stage) and
`jaxcpp.core.fake_executor.FakeExecutor` (deterministic tokens, modelled step times, no jax). The
in-process one and the fake are both KV sub-protocols; the multi-process one only offers (a consumer's
stages run in its process: `--kv-transfer-config` says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jaxcpp.core.kv_transfer import KVOffer, KVPull
from jaxcpp.core.step_input import StepInput, StepShape
from jaxcpp.core.step_result import Logprobs, StageTiming, StepResult

__all__ = ["Executor", "ExecutorError", "FailureListener", "HostPhase", "KVConsumerExecutor", "KVProducerExecutor",
           "Logprobs", "StageTiming", "StepRequest", "StepResult"]


@dataclass(frozen=True, eq=False)
class StepRequest:
    """One step as the engine hands it to every executor (in process, stage processes, fake): its inputs
    and what it wants back. The executor keeps it by `step_id` until the step is collected."""

    step_id: int
    step: StepInput
    want_tokens: bool = True      # False: a step of middle prefill chunks samples nothing; collect never waits
    want_logits: bool = False     # [S, V] float32 to the host (tests, exactness)
    ack: bool = False             # collect waits for every stage's timing (dynamic chunking)
    feedback_from: int | None = None  # a step in flight whose tokens this step's placeholders read
    want_logprobs: bool = False   # each sampled token's logprob and the top MAX_LOGPROBS
    want_prompt_logprobs: bool = False  # every prompt token's (`echo`)
    bitmask: np.ndarray | None = None  # [max_num_seqs, ceil(V / 32)] int32: constrained rows' allowed tokens
    defer_sampling: bool = False  # the forward only: `sample(step_id, bitmask)` draws (`defers_masks` executors)

    @property
    def wants_result(self) -> bool:
        """Anything to bring home from the last stage (else collect waits only for the acks)."""
        return self.want_tokens or self.want_logits or self.want_logprobs or self.want_prompt_logprobs

    def flags(self) -> dict[str, Any]:
        """What a stage process needs besides the arrays (the wire header's fields)."""
        return {"want_tokens": self.want_tokens, "want_logits": self.want_logits,
                "feedback_from": self.feedback_from, "want_logprobs": self.want_logprobs,
                "want_prompt_logprobs": self.want_prompt_logprobs}


@dataclass(frozen=True)
class HostPhase:
    """Where the engine loop's own time went: one phase of one step (perf_counter seconds)."""

    name: str             # schedule, build, mask, dispatch, wait, postprocess, or gc (a collector pause)
    step: int             # the scheduler's step id
    start: float
    end: float


class ExecutorError(RuntimeError):
    """A stage or device failed a micro-batch. `fatal`: the executor cannot run further steps.
    `where`: the stage's process, host and address, when it runs in a process of its own."""

    def __init__(self, message: str, *, stage: int | None = None, fatal: bool = True, where: str = "") -> None:
        prefix = f"stage {stage}{f' ({where})' if where else ''}: " if stage is not None else ""
        super().__init__(prefix + message)
        self.stage = stage
        self.fatal = fatal


FailureListener = Callable[[ExecutorError], None]


class Executor(Protocol):
    max_in_flight: int

    def warmup(self, shape: StepShape) -> float: ...

    def submit(self, request: StepRequest) -> None: ...

    def collect(self, step_id: int) -> StepResult: ...

    def time_attention_free_forward(self, num_tokens: int) -> float:
        """Seconds of one forward of a token bucket with attention skipped, on the slowest stage."""
        ...

    def num_compilations(self) -> int: ...

    @property
    def mla_rebuild_weight(self) -> float | None:
        """An MLA model's weight of the rebuild in its per-step prefill rule (`--mla-prefill`;
        `jaxcpp.chunking.mla_cost.prefer_rebuild`), so the host knows which form its chunks run; None
        for other models. Stages measure their own under auto: the first stage's."""
        ...

    def record_host_phases(self, phases: list[HostPhase]) -> None:
        """The engine loop's phases of one `step()`, for the trace (`--trace-file`); may ignore them."""
        ...

    def add_failure_listener(self, callback: FailureListener) -> None:
        """`callback(error)` once, from any thread, when the executor fails outside submit and collect
        (the server turns NOT_SERVING even while the engine idles); at once if it already failed."""
        ...

    def close(self) -> None: ...


class KVProducerExecutor(Executor, Protocol):
    """A producer's executor: it offers a prefilled request's pages to the consumer that asked."""

    def offer_kv(self, transfer_id: int, pages: list[int]) -> KVOffer:
        """Gather `pages` (in order with the steps, so later steps may reuse them) and offer them under
        `transfer_id` for the transfer timeout; returns at once."""
        ...


class KVConsumerExecutor(Executor, Protocol):
    """A consumer's executor: it pulls a producer's offer onto its devices and writes it into its pages."""

    def pull_kv(self, offer: KVOffer, transfer_id: int) -> KVPull:
        """Start pulling `offer`; returns at once, the arrays arrive while steps run."""
        ...

    def kv_arrived(self, pull: KVPull) -> bool:
        """Whether every array of `pull` is here (never blocks); raises when the transfer failed."""
        ...

    def import_kv(self, pull: KVPull, pages: list[int]) -> None:
        """Write an arrived pull into `pages` (in order with the steps)."""
        ...
