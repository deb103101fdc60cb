"""The in-process pipeline executor: P stages on a ("pp", "tp") mesh, up to P micro-batches in flight.

    ticket = executor.submit(step)     # the step's arrays onto every stage, then stage 0 .. P-1
                                       # dispatched in order, activations handed on with device_put;
                                       # nothing here waits for a device
    result = executor.collect(ticket)  # FIFO; returns at once. Reading `result.tokens` waits for the
                                       # last stage, so a step of middle prefill chunks (whose tokens the
                                       # engine never reads) retires at the head without waiting.
    executor.submit(step, wait_for_last_stage=True)
                                       # the flag rides in every stage's batch record; collect() then
                                       # blocks until the last stage acknowledged the batch (dynamic
                                       # chunking needs its timing before sizing the next chunk)

Ordering is all JAX's: each stage's KV pages are donated, so a stage runs its micro-batches in
submission order, and a stage's input is the previous stage's output, so a micro-batch runs its stages
in order. On GPUs async dispatch lets stage 0 of batch k+1 run while stage 1 runs batch k. Per-stage
watcher threads (`jaxcpp.runtime.timing`) time every stage of every micro-batch without blocking the
loop; `--trace-file` streams those timings as a Chrome/Perfetto trace.

A multi-process executor (one OS process per stage: the route to multi-host) fits the same interface:
the head process keeps `submit`/`collect`/`max_in_flight`, sends each stage process the step's arrays
plus this batch record (ticket, num_tokens, wait_for_last_stage), and stage processes pass activations
to their successor with `jax.experimental.transfer` (or a pairwise collective under
`jax.distributed`); the last stage sends tokens (and, when the flag asks, its acknowledgement and
timings) back to the head. `Stage` already is that process's whole job. See docs/pipeline.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import jax

from jaxcpp.config import EngineConfig
from jaxcpp.models import llama
from jaxcpp.runtime.executor import StepResult
from jaxcpp.runtime.mesh import make_mesh, stage_layers, stage_mesh
from jaxcpp.runtime.model_runner import StepOutput, dummy_step, warm_up_buckets
from jaxcpp.runtime.packing import pack
from jaxcpp.runtime.stage import Stage, StageInput
from jaxcpp.runtime.timing import StageBatch, StageTiming, TimingRecorder
from jaxcpp.runtime.trace import TraceWriter
from jaxcpp.step_input import StepInput

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    ticket: int
    output: StepOutput          # the last stage's (device) output
    wait_for_last_stage: bool


class PipelineExecutor:
    def __init__(self, stages: list[Stage], trace_file: str | None = None) -> None:
        self.stages = stages
        self.max_in_flight = len(stages)
        names = [f"stage {s.index}: layers {s.layers[0]}-{s.layers[1] - 1}, devices "
                 f"{','.join(str(d.id) for d in s.devices)}" for s in stages]
        self._trace = TraceWriter(trace_file, time.perf_counter(), names) if trace_file else None
        self._timing = TimingRecorder(len(stages), self._trace.add if self._trace else None)
        self._pending: deque[_InFlight] = deque()
        self._next_ticket = 0
        self._traced = False                       # warm-up batches stay out of the trace
        self._shape: tuple[int, int] | None = None  # (max_num_seqs, pages_per_seq), set by warmup
        self._dummy_ready: set[int] = set()

    # ---- the Executor interface ----------------------------------------------------------------
    def warmup(self, token_buckets: list[int], max_num_seqs: int, pages_per_seq: int) -> float:
        """Compile every stage's program for every bucket (and the transfers between stages) now."""
        self._shape = (max_num_seqs, pages_per_seq)

        def run(step: StepInput) -> None:
            result = self.collect(self.submit(step, wait_for_last_stage=True))
            _ = result.tokens, result.logits()  # the host reads are warmed too

        seconds = warm_up_buckets(run, token_buckets, max_num_seqs, pages_per_seq,
                                  where=f" on {len(self.stages)} stages")
        self._traced = True
        return seconds

    def submit(self, step: StepInput, wait_for_last_stage: bool = False) -> int:
        if len(self._pending) >= self.max_in_flight:
            raise RuntimeError(f"{self.max_in_flight} micro-batches already in flight: collect one first")
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        records, hidden = [], None
        for stage, batch in zip(self.stages, self._put_step(step), strict=True):
            if hidden is not None:
                hidden = stage.receive(hidden)
            inputs = (batch.packed, hidden)
            dispatched = time.perf_counter()
            hidden = stage.run(batch, hidden)
            records.append(StageBatch(ticket, stage.index, step.num_tokens_padded, wait_for_last_stage,
                                      self._traced, dispatched, inputs, hidden))
        out: StepOutput = hidden
        out.tokens.copy_to_host_async()  # the tokens start home as soon as they exist
        self._timing.watch(records)
        self._pending.append(_InFlight(ticket, out, wait_for_last_stage))
        return ticket

    def collect(self, ticket: int) -> StepResult:
        head = self._pending.popleft()
        if head.ticket != ticket:
            self._pending.appendleft(head)
            raise ValueError(f"tickets are collected in FIFO order: expected {head.ticket}, got {ticket}")
        if head.wait_for_last_stage:
            self._timing.wait_for_ack(ticket)
        return StepResult(head.output.tokens, head.output.logits)

    # ---- timing (for dynamic-chunking calibration and traces) ----------------------------------
    def forward_time(self, ticket: int) -> float | None:
        """Seconds of the slowest stage's forward for micro-batch `ticket`, once every stage is timed
        (right after `collect` when it was submitted with wait_for_last_stage=True; else a bit later)."""
        return self._timing.forward_time(ticket)

    def timings(self) -> list[StageTiming]:
        """Every recorded (micro-batch, stage) timing, oldest first (bounded; warm-up included)."""
        return self._timing.timings()

    def time_dummy_forward(self, num_tokens: int) -> float:
        """Seconds of an attention-free forward of `num_tokens` (a token bucket) on the slowest stage,
        timed around each stage's model call only (inputs staged and ready before the clock starts).

        Its programs are NOT part of warm-up: each bucket's is compiled on its first call here, which
        also runs it once untimed. So a start-up calibration sweep compiles after `warmup()`, and a
        compile guard around serving must start after the sweep.
        """
        if self._shape is None:
            raise RuntimeError("time_dummy_forward() needs warmup() first (it fixes the batch shapes)")
        max_num_seqs, pages_per_seq = self._shape
        step = dummy_step(num_tokens, max_num_seqs, pages_per_seq)
        if num_tokens not in self._dummy_ready:
            self._dummy_forward(step)
            self._dummy_ready.add(num_tokens)
        return max(self._dummy_forward(step))

    def _dummy_forward(self, step: StepInput) -> list[float]:
        seconds, hidden = [], None
        for stage, batch in zip(self.stages, self._put_step(step), strict=True):
            if hidden is not None:
                hidden = stage.receive(hidden)
            jax.block_until_ready((batch.packed, hidden, stage.kv))  # also drains micro-batches in flight
            t0 = time.perf_counter()
            hidden = jax.block_until_ready(stage.run_dummy(batch, hidden))
            seconds.append(time.perf_counter() - t0)
        return seconds

    def _put_step(self, step: StepInput) -> list[StageInput]:
        """The step packed once on the host and put on every stage's devices in one `device_put`."""
        buf, layout = pack(step)
        bufs = jax.device_put([buf] * len(self.stages), [stage.replicated for stage in self.stages])
        return [StageInput(b, layout) for b in bufs]

    def close(self) -> None:
        """Stop the watchers and finish the trace file (also done at interpreter exit)."""
        self._timing.close()
        if self._trace is not None:
            self._trace.close()


def build_pipeline_executor(config: EngineConfig, model: Any, attention_fn: llama.AttentionFn
                            ) -> PipelineExecutor:
    """The factory's entry for P x T > 1: check devices, split layers, place every stage."""
    p = config.parallel
    num_stages = p.pipeline_parallel_size
    mesh = make_mesh(num_stages, p.tensor_parallel_size)
    partition = p.partition_list() if p.pp_partition is not None else None
    bounds = stage_layers(model.config.num_hidden_layers, num_stages, partition)
    stages = [Stage(s, num_stages, stage_mesh(mesh, s), model.config, model.params, bounds[s], model.num_pages,
                    config.cache.block_size, attention_fn) for s in range(num_stages)]
    log.info("pipeline: %d stage(s) x %d device(s), layers per stage %s",
             num_stages, p.tensor_parallel_size, [e - s for s, e in bounds])
    return PipelineExecutor(stages, p.trace_file)
