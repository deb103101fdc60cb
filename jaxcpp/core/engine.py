"""The engine loop: schedule -> submit -> collect -> postprocess. Host only: no jax, even transitively.

The engine owns the host state (requests, pages, scheduler) and talks to the model only through an
executor (`jaxcpp.core.executor`): step inputs go in, host arrays come back. With a pipeline of P stages up
to P steps are in flight: the loop keeps submitting while the pipe has room and something can be
scheduled, and collects the oldest step when the pipe is full or there is nothing new to send.

Async scheduling (on by default, as in vLLM; `async_scheduling=False` turns it off) keeps one more
step in flight: step k+1 is scheduled, built and submitted while step k still runs, and its decodes
whose input token step k is sampling take it on the device (`Scheduler.schedule(feedback_from=)`), so
the device does not wait through the host's schedule / build / postprocess between steps.

    LLMEngine(config)                      # plans sizes from the model folder, builds the real executor
    LLMEngine(config, executor=FakeExecutor(...))   # any executor: tests and tools, no jax needed

Structured outputs' engine side (grammars, masks, late draws) is one seam: `jaxcpp.core.constrained`.

A failed stage surfaces as `ExecutorError`: the requests of the steps in flight end with finish reason
"error" (their pages freed); a fatal one then propagates, since the executor cannot run more steps.
Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

from jaxcpp.chunking.controller import DynamicChunkController
from jaxcpp.chunking.mla_cost import MlaShape
from jaxcpp.config import EngineConfig, SchedulerConfig
from jaxcpp.core.constrained import ConstrainedDecoding
from jaxcpp.core.disaggregation import KVConsumer, KVProducer, check_kv_transfer
from jaxcpp.core.executor import Executor, ExecutorError, FailureListener, StepRequest, StepResult
from jaxcpp.core.gc_heap import freeze_startup_heap, thaw
from jaxcpp.core.in_flight import InFlight
from jaxcpp.core.kv_transfer import KVTransferRequest, RemotePrefill, TransferCounts
from jaxcpp.core.outputs import EngineStats, ModelInfo, RequestMetrics, RequestOutput
from jaxcpp.core.page_allocator import PageAllocator
from jaxcpp.core.phases import PhaseRecorder
from jaxcpp.core.scheduler import Scheduler, SchedulerOutput, StopRule
from jaxcpp.core.sequence import Sequence
from jaxcpp.core.sizing import EngineSizing, parameter_summary
from jaxcpp.core.stats_logger import StatsLogger
from jaxcpp.core.step_input import StepInput, build_step_input, failing_chunks
from jaxcpp.errors import InvalidRequestError
from jaxcpp.models.spec import ModelSpec, resolve_model_spec
from jaxcpp.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, *,
                 record_logits: bool = False, freeze_heap: bool | None = None) -> None:
        """`freeze_heap`: freeze start-up's objects out of the garbage collector's way after warm-up
        (`jaxcpp.core.gc_heap`). Default: when the engine builds its executor itself (a server, `LLM(model=)`);
        not when handed one (tests and tools build many engines per process, and each freeze walks the
        whole heap once, ~0.25 s)."""
        self.config = config
        self.record_logits = record_logits
        spec = resolve_model_spec(config.model.model, config.model.dtype)  # a bad folder fails first
        built_here = executor is None
        if executor is None:
            executor, self.sizing = build_executor(config, spec)
        else:
            self.sizing = EngineSizing.plan(config, spec)
        self.tokenizer = self.sizing.spec.tokenizer
        self.executor: Executor = executor
        self.allocator = PageAllocator(self.sizing.num_pages)
        self.chunking = self._build_chunk_controller()  # None: fixed chunks (Sarathi's rule)
        self._stop_rule = StopRule(self.sizing.eos_token_ids, self.sizing.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.sizing.page_size, self.chunking,
                                   self._stop_rule, prefix_caching=config.cache.enable_prefix_caching)
        self.warmup_seconds = self.executor.warmup(self.sizing.shape)
        if self.chunking is not None:
            self.chunking.run_startup_sweep(self.executor.time_attention_free_forward)
        self._compilations_at_warmup = self.executor.num_compilations()
        self._frozen = built_here if freeze_heap is None else freeze_heap
        if self._frozen:  # a full GC pass over start-up's objects stalled every stream (jaxcpp.core.gc_heap)
            freeze_startup_heap()
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: InFlight[SchedulerOutput] = InFlight(self.executor.max_in_flight + self.async_scheduling)
        self._released: set[int] = set()  # steps in flight the executor holds nothing of (failed there)
        self._aborted: list[RequestOutput] = []
        self._phases = PhaseRecorder()
        self._seed_rng = random.Random(config.model.seed)
        self._stats = StatsLogger(config.scheduler.log_stats_interval_s)
        self.kv = config.kv_transfer.settings()   # None: not disaggregated
        self.kv_layout = self.sizing.kv_layout()
        self.remote: RemotePrefill | None = None  # a consumer's producers (`attach_remote_prefill`)
        self._consumer: KVConsumer | None = None   # disaggregation's engine side (`jaxcpp.core.disaggregation`)
        self._producer = KVProducer(executor, self.sizing.page_size) if self.kv and self.kv.produces else None
        self._constrained = ConstrainedDecoding(self.scheduler, executor, self.sizing, self.async_scheduling,
                                                self._output, on_failed_draw=self._released.add)
        log.info("model %s: %s", self.sizing.spec.name, parameter_summary(self.sizing.spec.config))
        log.info("engine ready: %d buckets %s compiled in %.1fs, %d KV pages of %d tokens (+1 reserved "
                 "padding page) in %s",
                 len(self.sizing.shape.buckets), self.sizing.shape.buckets, self.warmup_seconds,
                 self.allocator.num_usable, self.sizing.page_size, self.sizing.kv_cache_dtype)

    def _build_chunk_controller(self) -> DynamicChunkController | None:
        if not self.config.dynamic_chunking:  # off on a kv_consumer (EngineConfig says why)
            return None
        controller = DynamicChunkController.from_config(self.config, allowed_sizes=tuple(self.sizing.token_buckets),
                                                        max_model_len=self.sizing.max_model_len)
        if (weight := self.executor.mla_rebuild_weight) is not None:  # calibrate the form the stages run
            controller.plan_mla_prefill(MlaShape.of(self.sizing.spec.config), weight)
        return controller

    def attach_remote_prefill(self, remote: RemotePrefill) -> None:
        """A consumer's producers: from now on a prompt is prefilled by one of them (`KVConsumer`)."""
        assert self.kv is not None and self.kv.consumes, "a remote prefill is for a kv_consumer"
        self.remote = remote
        self._consumer = KVConsumer(remote, self.executor, self.scheduler, self.sizing.page_size,
                                    self.kv.transfer_timeout_s, self._output)

    def close(self) -> None:
        """Release the executor (its threads, trace file, devices) and the frozen heap. Idempotent."""
        self._constrained.close()
        if self._consumer is not None:
            self._consumer.close()
        self.executor.close()
        self._phases.close()
        if self._frozen:
            thaw()
            self._frozen = False

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, group: str | None = None,
                    kv_transfer: KVTransferRequest | None = None) -> None:
        """`group`: the samples of one prompt (n > 1) share one id here, so they share one prefill.
        `kv_transfer` (a producer's): a consumer's prefill, whose pages are offered once it has sampled."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, self.sizing, self.config.scheduler)
        if kv_transfer is not None:
            check_kv_transfer(self._producer, kv_transfer, token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        seq = Sequence(request_id, token_ids, params, seed,
                       RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
                       banned_ids=self._stop_rule.banned_ids(params, self.sizing.spec.config.vocab_size),
                       group=group, kv_transfer=kv_transfer)
        if params.structured_outputs is not None:
            self._constrained.add(seq)  # its grammar compiles in the pool: it waits for it in the scheduler
        if self._consumer is not None and not params.reads_history_on_device and seq.grammar is None:
            self.scheduler.add_remote(seq)
        else:  # and on a consumer, a request whose prompt must pass its own device (penalties, prompt logprobs)
            # or whose first token its own grammar masks (a constrained one)
            self.scheduler.add(seq)

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model folder has no tokenizer.json: send token ids")
        return self.tokenizer.encode(prompt) if prompt else []  # empty text is an empty prompt, BOS or not

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request now and free its pages; `reason` "stop" when the edge matched a stop string."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return
        if self._consumer is not None:
            self._consumer.abort(request_id)  # its pull may still land: it is dropped, never written
        self.scheduler.finish(seq, reason, time.monotonic())
        self._aborted.append(self._output(seq, []))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self._in_flight or self._aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Submit the next step while the pipe has room; collect the oldest when it is full or idle."""
        start = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        outputs += self._constrained.failed_grammars()  # a grammar that failed to build: its request's error
        if self._consumer is not None:  # a kv_consumer's remote prefills: pulled and admitted here
            busy = self._in_flight or self.scheduler.running or self.scheduler.waiting
            outputs += self._consumer.step(idle=not busy)
        submitted = collect = False
        try:
            submitted = self._in_flight.has_room() and self._submit_next()
            collect = bool(self._in_flight) and (not self._in_flight.has_room() or not submitted)
            if collect:
                outputs += self._collect_oldest()
        except ExecutorError as error:
            outputs += self._fail_in_flight(error)
        self.executor.record_host_phases(self._phases.take())
        self._log_stats(time.perf_counter() - start if submitted or collect else 0.0)  # busy time only
        return outputs

    def _log_stats(self, busy_s: float) -> None:
        self._stats.add_busy(busy_s)
        if self._stats.due():
            self._stats.log(self.stats(), self.chunking.report() if self.chunking is not None else None)

    def _submit_next(self) -> bool:
        oldest = self._in_flight.oldest if self.async_scheduling and self._in_flight else None
        if self._constrained.holds_back(oldest.step_id if oldest else None):
            return False  # a draw or a constrained token to collect first (jaxcpp.core.constrained)
        phase = self._phases.timer(self.scheduler.num_steps)
        with phase("schedule"):
            sched = self.scheduler.schedule(feedback_from=oldest.step_id if oldest else None)
        if sched.is_empty:
            return False
        with phase("build"):
            step = self._build(sched)
        if step is None:
            return True  # every request of the step failed (their outputs go out with the next step's)
        bitmask, deferred = self._constrained.masks(sched, phase)
        try:
            with phase("dispatch"):
                self.executor.submit(StepRequest(
                    sched.step_id, step, want_tokens=sched.samples, want_logits=self.record_logits, ack=sched.ack,
                    feedback_from=sched.feedback_from if sched.feeds_back else None,
                    want_logprobs=sched.wants_logprobs, want_prompt_logprobs=sched.wants_prompt_logprobs,
                    bitmask=bitmask, defer_sampling=deferred))
        except ExecutorError:
            self._in_flight.append(sched, sched.num_decodes > 0)  # never submitted: it fails with those in flight
            self._released.add(sched.step_id)
            raise
        self._in_flight.append(sched, sched.num_decodes > 0)
        self._constrained.submitted(sched, deferred)
        self.scheduler.publish_written_pages(sched)  # submitted: later steps may read what it writes
        self._stats.count_scheduled(sched)
        return True

    def _build(self, sched: SchedulerOutput) -> StepInput | None:
        """The step's input. The rule for an exception while building it: a request's chunk that
        fails when built alone is that request's error (a value validation let through): the request
        ends with reason "error" (pages freed, its client told) and the step goes on without it. If
        no chunk fails alone, or the rest still fails, the error is the engine's and propagates.
        None: no request of the step was left."""
        try:
            return build_step_input(sched, self.sizing.shape)
        except Exception:
            failed = failing_chunks(sched, self.sizing.shape)
            if not failed:
                raise
        now, bad = time.monotonic(), {i for i, _ in failed}
        for i, error in failed:
            seq = sched.chunks[i].seq
            log.error("request %r failed building its step input: %r", seq.request_id, error)
            self.scheduler.finish(seq, "error", now)
            self._aborted.append(dataclasses.replace(self._output(seq, []), error=f"its step input could not be "
                                                     f"built: {type(error).__name__}: {error}"))
        self.scheduler.drop_chunks(sched, bad)
        return build_step_input(sched, self.sizing.shape) if sched.chunks else None

    def _collect_oldest(self) -> list[RequestOutput]:
        sched = self._in_flight.oldest  # taken off only once collected: a failure keeps it
        phase = self._phases.timer(sched.step_id)
        try:
            with phase("wait"):
                result = self.executor.collect(sched.step_id)
            self._check_tokens(sched, result)
        except ExecutorError:
            self._released.add(sched.step_id)  # the executor holds nothing more of it
            raise
        self._in_flight.popleft()
        with phase("postprocess"):
            if self._producer is not None:
                self._producer.offer(sched)  # before postprocess frees the pages
            sampled = self.scheduler.postprocess(sched, result, time.monotonic())
            self._stats.count_sampled(len(sampled))
            outputs = [self._output(seq, seq.output_token_ids[-1:]) for seq in sampled]
        self._constrained.draw_late(sched.step_id, phase)  # the next step's draw, if it waited for this one
        return outputs

    def _check_tokens(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Garbage from a device must not become a request's output: ids outside the vocabulary fail the
        step (and only it: the executor may well run the next one)."""
        if result.tokens is None:
            return
        rows = [i for i, chunk in enumerate(sched.chunks) if chunk.samples]
        tokens = result.tokens[rows]
        vocab = self.sizing.spec.config.vocab_size
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ExecutorError(f"sampled token ids outside the vocabulary [0, {vocab}): "
                                f"{sorted(set(tokens.tolist()))[:4]}", fatal=False)

    def _fail_in_flight(self, error: ExecutorError) -> list[RequestOutput]:
        """Every request with a step in flight ends with reason "error"; a fatal error then propagates."""
        log.error("executor failed: %s; failing the requests of %d step(s) in flight", error, len(self._in_flight))
        now, outputs = time.monotonic(), []
        self.scheduler.forget_cached_pages()  # pages the failed steps were to write may be unwritten
        self._constrained.awaiting = None
        while self._in_flight:
            sched = self._in_flight.popleft()
            if sched.step_id not in self._released and not error.fatal:
                self._discard(sched.step_id)  # the executor keeps running: take back what it still holds
            for chunk in sched.chunks:
                if not chunk.seq.is_finished:
                    self.scheduler.finish(chunk.seq, "error", now)
                    outputs.append(dataclasses.replace(self._output(chunk.seq, []), error=str(error)))
        self._released.clear()
        if error.fatal:
            raise error
        return outputs

    def _discard(self, step_id: int) -> None:
        try:
            self.executor.collect(step_id)
        except ExecutorError as e:
            log.error("a step in flight with the failed one failed too: %s", e)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """What this step added to `seq` (and, once it finished, all its tokens). Prompt log-probabilities,
        all scored by the time the first token is, ride on the first output and the finished one."""
        p, generated = seq.params, seq.output_token_ids
        new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_token_ids):] if p.logprobs is not None else None
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(generated) if seq.is_finished else [],
                             new_token_ids, seq.is_finished, seq.finish_reason, seq.metrics,
                             logits=seq.logits or None, num_cached_tokens=seq.num_cached_tokens,
                             logprobs=new_logprobs,
                             prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None
                             and (seq.is_finished or len(new_token_ids) == len(generated)) else None,
                             num_generated=len(generated), kv_offer=seq.kv_offer if seq.is_finished else None)

    def add_failure_listener(self, callback: FailureListener) -> None:
        """`callback(error)` when the executor fails between steps (a stage process died while idle)."""
        self.executor.add_failure_listener(callback)

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        transfers = self._consumer.transfers if self._consumer is not None else TransferCounts()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.remote),  # a consumer's: prefilling elsewhere
            num_pages_used=self.allocator.num_used, num_pages_free=self.allocator.num_free,
            num_pages_total=self.allocator.num_usable,
            num_compilations_since_warmup=self.executor.num_compilations() - self._compilations_at_warmup,
            num_prompt_tokens_total=self._stats.prompt_tokens_total,
            num_generation_tokens_total=self._stats.generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            dynamic_chunking=self.chunking.stats() if self.chunking is not None else {"state": "off"},
            num_prefix_cache_queried_tokens_total=self.scheduler.prefix_queried_tokens,
            num_prefix_cache_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            num_pages_cached=self.allocator.num_cached,
            num_prefix_cache_evictions_total=self.allocator.num_evictions,
            num_kv_transfers_total=transfers.transfers, num_kv_transfer_bytes_total=transfers.bytes,
            num_kv_transfer_tokens_total=transfers.tokens,
            num_kv_transfer_microseconds_total=transfers.microseconds,
            num_remote_prefill_microseconds_total=transfers.prefill_microseconds)

    def model_info(self) -> ModelInfo:
        c, m = self.config, self.sizing.spec.config
        return ModelInfo(self.sizing.spec.name, m.architecture, m.vocab_size, self.sizing.max_model_len,
                         m.num_hidden_layers, m.hidden_size, m.dtype, self.sizing.page_size,
                         c.scheduler.max_num_batched_tokens, c.parallel.pipeline_parallel_size,
                         c.parallel.tensor_parallel_size, self.sizing.eos_token_ids, self.sizing.kv_cache_dtype,
                         self.kv.role if self.kv is not None else "", self.kv_layout)


def check_request(token_ids: list[int], params: SamplingParams, sizing: EngineSizing,
                  scheduler: SchedulerConfig) -> None:
    """Refuse a request the engine cannot run, naming the field (`InvalidRequestError`): the one place
    these checks are made, for every front end (an empty prompt included). Needs only the sizing, so
    `jaxcpp generate` checks its prompt before it loads the model and compiles."""
    max_len, vocab = sizing.max_model_len, sizing.spec.config.vocab_size
    if not token_ids:
        raise InvalidRequestError("prompt", "is empty")
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    if len(token_ids) > max_len:
        raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens, more than --max-model-len {max_len}")
    if len(token_ids) + params.max_tokens > max_len:
        raise InvalidRequestError("max_tokens", f"prompt ({len(token_ids)} tokens) + max_tokens "
                                  f"({params.max_tokens}) exceeds --max-model-len {max_len}")
    budget = scheduler.max_num_batched_tokens
    if not scheduler.enable_chunked_prefill and len(token_ids) > budget:
        raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; without chunked prefill a "
                                  f"prompt must fit --max-num-batched-tokens {budget}")


def build_executor(config: EngineConfig, spec: ModelSpec) -> tuple[Executor, EngineSizing]:
    """The real executor and the sizing it runs with, both settled where the backend is known (`--dtype
    auto` depends on it). Imported here, so that importing the engine imports no jax: a multi-process
    pipeline's head asks its stages and never imports jax at all (`jaxcpp.head.mp_executor`); in
    process, the device side does it (`jaxcpp.runtime.factory`)."""
    if config.parallel.executor_backend == "mp":
        from jaxcpp.head.mp_executor import MultiProcessExecutor

        mp = MultiProcessExecutor(config, spec)
        return mp, mp.sizing
    from jaxcpp.runtime import factory

    return factory.build_executor(config, spec)
