"""The in-process executor: P stages on a ("pp", "tp") mesh, P micro-batches in flight (+1 queued; P = 1 too).

    executor.submit(StepRequest(step_id, step))  # the step packed once, put on every stage (`Stage.put`),
                                        # then stage 0 .. P-1 dispatched in order, activations handed
                                        # on with device_put; nothing here waits for a device
    result = executor.collect(step_id)  # waits until the step has left the last stage, and for what
                                        # it asked: its tokens, its logits, or with `ack` every
                                        # stage's timing of it

Ordering is all JAX's: each stage's KV pages are donated, so a stage runs its micro-batches in
submission order, and a stage's input is the previous stage's output, so a micro-batch runs its stages
in order. On GPUs async dispatch lets stage 0 of batch k+1 run while stage 1 runs batch k (XLA:CPU
does not overlap devices of one process). Per-stage watcher threads (`jaxcpp.runtime.timing`) time
every stage of every micro-batch without blocking the loop; `--trace-file` streams those timings as a
Chrome/Perfetto trace. The contract is `jaxcpp.core.executor`; see docs/pipeline.md.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np

from jaxcpp.config import KVSettings
from jaxcpp.core.buckets import bucket_progress
from jaxcpp.core.executor import (
    ExecutorError,
    FailureListener,
    HostPhase,
    Logprobs,
    StageTiming,
    StepRequest,
    StepResult,
)
from jaxcpp.core.kv_transfer import KVOffer, KVPull, KVSource
from jaxcpp.core.step_input import StepInput, StepShape, pack, padding_step
from jaxcpp.pipe.trace import TraceWriter
from jaxcpp.runtime import compile_guard
from jaxcpp.runtime.kv_transport import KVTransport, PulledPages, gather_offer
from jaxcpp.runtime.stage import PromptLogprobs, Stage, StageInput, StepOutput
from jaxcpp.runtime.stage_ops import COMPILE_THREADS, compile_buckets, time_attention_free
from jaxcpp.runtime.timing import DispatchedStage, TimingRecorder

log = logging.getLogger(__name__)


@dataclass
class _Submitted:
    request: StepRequest
    output: StepOutput          # the last stage's (device) output
    prompt_logprobs: PromptLogprobs | None = None  # dispatched when the step asked for them


class PipelineExecutor:
    defers_masks = True  # `StepRequest(defer_sampling=True)`, then `sample(step_id, bitmask)` (structured.request)

    def __init__(self, stages: list[Stage], trace_file: str | None = None, kv: KVSettings | None = None) -> None:
        """`kv`: this instance's part in disaggregation (its transfer server starts here), or None."""
        compile_guard.install()
        self._compilations_at_start = compile_guard.num_compilations()
        self.stages = stages
        self.max_in_flight = len(stages)
        names = [f"stage {s.index}: layers {s.layers[0]}-{s.layers[1] - 1}, devices "
                 f"{','.join(str(d.id) for d in s.devices)}" for s in stages]
        self._trace = TraceWriter(trace_file, time.perf_counter(), names) if trace_file else None
        self._timing = TimingRecorder(len(stages), self._trace.add if self._trace else None)
        self._submitted: dict[int, _Submitted] = {}  # by step id, until collected
        self._warmup_ids = itertools.count(-1, -1)   # its own steps' ids, below the scheduler's
        self._traced = False                # warm-up batches stay out of the trace
        self._shape: StepShape | None = None  # set by warmup
        self._attention_free_ready: set[int] = set()
        self._closed = False
        self._kv = kv
        self._transport = KVTransport(kv.ip) if kv is not None else None

    # ---- the Executor contract -----------------------------------------------------------------
    def warmup(self, shape: StepShape) -> float:
        """Compile every stage's program for every bucket, `COMPILE_THREADS` buckets at a time, then run
        each bucket once through the whole pipe (the transfers between stages, the host reads)."""
        self._shape = shape
        buckets = shape.buckets
        log.info("compiling %d programs on %d stage(s), one per token bucket %s, %d at a time ...",
                 len(buckets), len(self.stages), buckets, min(COMPILE_THREADS, len(buckets)))
        start = time.perf_counter()
        where = f" on {len(self.stages)} stage(s)"
        compile_buckets(self.stages, shape, lambda b: log.info("%s", bucket_progress(
            b.index, len(buckets), b.num_tokens, b.seconds, b.programs, b.from_cache, where)), self._kv)
        for num_tokens in buckets:
            step_id = next(self._warmup_ids)
            self.submit(StepRequest(step_id, padding_step(num_tokens, shape), want_logits=True, ack=True,
                                    want_logprobs=True, want_prompt_logprobs=shape.scores_prompt_tokens(num_tokens)))
            self.collect(step_id)
        self._traced = True
        log.info("warm-up: %d programs compiled and run in %.1fs", len(buckets), time.perf_counter() - start)
        return time.perf_counter() - start

    def submit(self, request: StepRequest) -> None:
        """`request.defer_sampling`: the last stage stops at the logits; `sample(step_id, bitmask)` draws."""
        r, step, step_id = request, request.step, request.step_id
        records: list[DispatchedStage] = []
        fed_back = self._fed_back(r.feedback_from)  # tokens the first stage's placeholder decodes read
        hidden: Any = None
        for stage, batch in zip(self.stages, self._put_step(step, r.bitmask, r.defer_sampling), strict=True):
            try:
                if hidden is not None:
                    hidden = stage.receive(hidden)
                inputs = (batch.packed, hidden, fed_back)
                dispatched = time.perf_counter()
                hidden = stage.run(batch, hidden, fed_back)  # only the first stage reads fed_back
            except Exception as e:  # a dispatch error (out of memory, a lost device) fails the step
                raise ExecutorError(f"dispatching micro-batch {step_id} failed: {e}", stage=stage.index) from e
            records.append(DispatchedStage(step_id, stage.index, step.num_tokens_padded, r.ack, self._traced,
                                           dispatched, inputs, hidden))
        out: StepOutput = hidden  # the last stage's output
        prompt_logprobs = self.stages[-1].run_prompt_logprobs(out) if r.want_prompt_logprobs else None
        self._timing.watch(records)
        self._submitted[step_id] = _Submitted(request, out, prompt_logprobs)
        if not r.defer_sampling:
            self._fetch(self._submitted[step_id])

    def sample(self, step_id: int, bitmask: np.ndarray | None) -> None:
        """Draw the tokens of a step submitted with `defer_sampling`, with its (now known) mask."""
        sub, stage = self._submitted[step_id], self.stages[-1]
        try:
            sub.output = stage.sample(sub.output, bitmask)  # the mask goes with the call (`Stage.sample`)
        except Exception as e:  # a dispatch error fails the step
            raise ExecutorError(f"sampling micro-batch {step_id} failed: {e}", stage=stage.index) from e
        self._fetch(sub)

    @staticmethod
    def _fetch(sub: _Submitted) -> None:
        out, r = sub.output, sub.request
        wanted = [[out.tokens] if r.want_tokens else [], [out.logits] if r.want_logits else [],
                  out.sampled[1:] if r.want_logprobs else (), sub.prompt_logprobs or ()]  # type: ignore[index]
        for array in (a for arrays in wanted for a in arrays):
            array.copy_to_host_async()  # start home as soon as they exist

    def _fed_back(self, feedback_from: int | None) -> Any:
        """The tokens of a step still in flight, moved (asynchronously) to the first stage's devices."""
        if feedback_from is None:
            return None
        return self.stages[0].receive_tokens(self._submitted[feedback_from].output.tokens)

    def collect(self, step_id: int) -> StepResult:
        head = self._submitted.pop(step_id)
        r = head.request
        if head.output.sampled is None:  # deferred, and never sampled: only a failed engine collects it so
            raise ExecutorError(f"micro-batch {step_id} was collected before it was sampled", fatal=False)
        timings = self._timing.wait_for_ack(step_id) if r.ack else ()
        try:
            jax.block_until_ready(head.output.tokens)  # out of the pipe: it holds no activation any more
            tokens = np.asarray(head.output.tokens) if r.want_tokens else None
            logits = np.asarray(head.output.logits) if r.want_logits else None
            logprobs = Logprobs(*map(np.asarray, head.output.sampled[1:])) if r.want_logprobs else None
            prompt = Logprobs(*map(np.asarray, head.prompt_logprobs)) if head.prompt_logprobs is not None else None
        except Exception as e:
            raise ExecutorError(f"micro-batch {step_id} failed: {e}", stage=len(self.stages) - 1) from e
        return StepResult(tokens, logits, timings, logprobs, prompt)

    def time_attention_free_forward(self, num_tokens: int) -> float:
        """Seconds of an attention-free forward of `num_tokens` (a token bucket) on the slowest stage,
        timed around each stage's model call only (inputs staged and ready before the clock starts).

        Its programs are NOT part of warm-up: each bucket's is compiled on its first call here, which
        also runs it once untimed. The engine runs the start-up sweep before it counts compilations.
        """
        if self._shape is None:
            raise RuntimeError("time_attention_free_forward() needs warmup() first (it fixes the shapes)")
        first_use = num_tokens not in self._attention_free_ready
        self._attention_free_ready.add(num_tokens)
        return max(self._attention_free_forward(padding_step(num_tokens, self._shape), first_use))

    def record_host_phases(self, phases: list[HostPhase]) -> None:
        if self._trace is not None and self._traced:
            for phase in phases:
                self._trace.add_host(phase)

    @property
    def mla_rebuild_weight(self) -> float | None:
        return self.stages[0].mla_rebuild_weight

    def num_compilations(self) -> int:
        return compile_guard.num_compilations() - self._compilations_at_start

    def add_failure_listener(self, callback: FailureListener) -> None:
        pass  # a stage in this process fails only inside submit or collect

    def close(self) -> None:
        """Stop the watchers and finish the trace file (also done at interpreter exit). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._timing.close()
        if self._trace is not None:
            self._trace.close()

    # ---- disaggregation: KV pages out (a producer) and in (a consumer) ---------------------------
    def offer_kv(self, transfer_id: int, pages: list[int]) -> KVOffer:
        """Gather `pages` (dispatched in order with the steps, so later steps may reuse them) and offer
        them on this process's transfer server for the transfer timeout."""
        assert self._kv is not None and self._transport is not None, "offer_kv needs --kv-transfer-config"
        self._transport.offer(transfer_id, gather_offer(self.stages, pages), self._kv.transfer_timeout_s)
        source = KVSource(self._transport.address, self.stages[0].layers[0], self.stages[-1].layers[1])
        return KVOffer((source,), len(pages))

    def pull_kv(self, offer: KVOffer, transfer_id: int) -> PulledPages:
        """Start pulling an offer onto the stages' devices; returns at once (the arrays arrive meanwhile)."""
        assert self._transport is not None, "pull_kv needs --kv-transfer-config"
        return PulledPages(self._transport, self.stages, offer, transfer_id)

    def kv_arrived(self, pull: KVPull) -> bool:
        return cast(PulledPages, pull).arrived()

    def import_kv(self, pull: KVPull, pages: list[int]) -> None:
        """Write a pull that has arrived into `pages` (the engine's thread: in order with the steps)."""
        cast(PulledPages, pull).write_into(pages)

    # ---- beyond the contract: probes for tests and benchmarks ------------------------------------
    def timings(self) -> list[StageTiming]:
        """Every recorded (micro-batch, stage) timing, oldest first (bounded; warm-up included)."""
        return self._timing.timings()

    def _attention_free_forward(self, step: StepInput, first_use: bool) -> list[float]:
        seconds, hidden = [], None
        for stage, batch in zip(self.stages, self._put_step(step), strict=True):
            if hidden is not None:
                hidden = stage.receive(hidden)
            elapsed, hidden = time_attention_free(stage, batch, hidden, first_use)
            seconds.append(elapsed)
        return seconds

    def _put_step(self, step: StepInput, bitmask: np.ndarray | None = None,
                  defer_sampling: bool = False) -> list[StageInput]:
        """The step packed once on the host and put on every stage's devices (`Stage.put`); a bitmask
        goes to the last stage alone, as a host array its sampler's call takes (`Stage.sample`)."""
        buf, layout = pack(step)
        inputs = [StageInput(stage.put(buf), layout, step.needs_full_sampler, num_seqs=int(step.num_seqs))
                  for stage in self.stages]
        inputs[-1] = inputs[-1]._replace(bitmask=bitmask, defer_sampling=defer_sampling)
        return inputs
