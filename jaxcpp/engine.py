"""The engine loop: schedule -> submit -> collect -> postprocess. Host only: no jax, even transitively.

The engine owns the host state (requests, pages, scheduler) and talks to the model only through an
executor (`jaxcpp.executor`): step inputs go in, host arrays come back. With a pipeline of P stages up
to P steps are in flight: the loop keeps submitting while the pipe has room and something can be
scheduled, and collects the oldest step when the pipe is full or there is nothing new to send.

Async scheduling (on by default, as in vLLM; `async_scheduling=False` turns it off) keeps one more
step in flight: step k+1 is scheduled, built and submitted while step k still runs, and its decodes
whose input token step k is sampling take it on the device (`Scheduler.schedule(feedback_from=)`), so
the device does not wait through the host's schedule / build / postprocess between steps.

    LLMEngine(config)                      # plans sizes from the model folder, builds the real executor
    LLMEngine(config, executor=FakeExecutor(...))   # any executor: tests and tools, no jax needed

A failed stage surfaces as `ExecutorError`: the requests of the steps in flight end with finish reason
"error" (their pages freed); a fatal one then propagates, since the executor cannot run more steps.
Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from jaxcpp.chunking.controller import DynamicChunkController
from jaxcpp.config import EngineConfig, SchedulerConfig
from jaxcpp.errors import InvalidRequestError
from jaxcpp.executor import Executor, ExecutorError, HostPhase, StepResult
from jaxcpp.gc_heap import GcWatch, freeze_startup_heap, thaw
from jaxcpp.in_flight import InFlight
from jaxcpp.models.spec import resolve_model_spec
from jaxcpp.outputs import EngineStats, ModelInfo, RequestMetrics, RequestOutput
from jaxcpp.page_allocator import PageAllocator
from jaxcpp.sampling_params import MAX_BANNED_IDS, SamplingParams
from jaxcpp.scheduler import ChunkSizer, FixedChunkSizer, Scheduler, SchedulerOutput, StopRule
from jaxcpp.sequence import Sequence
from jaxcpp.sizing import EngineSizing
from jaxcpp.stats_logger import StatsLogger
from jaxcpp.step_input import build_step_input

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, *,
                 record_logits: bool = False, freeze_heap: bool | None = None) -> None:
        """`freeze_heap`: freeze start-up's objects out of the garbage collector's way after warm-up
        (`jaxcpp.gc_heap`). Default: when the engine builds its executor itself (a server, `LLM(model=)`);
        not when handed one (tests and tools build many engines per process, and each freeze walks the
        whole heap once, ~0.25 s)."""
        self.config = config
        self.record_logits = record_logits
        spec = resolve_model_spec(config.model.model, config.model.dtype)  # a bad folder fails first
        device = _device_side() if executor is None else None
        if device is not None:
            spec = spec.with_dtype(device.resolve_dtype(config.model.dtype))
        self.sizing = EngineSizing.plan(config, spec)
        self.tokenizer = self.sizing.spec.tokenizer
        if device is not None:
            executor = device.build_executor(config, self.sizing)
        assert executor is not None
        self.executor: Executor = executor
        self.allocator = PageAllocator(self.sizing.num_pages)
        self.chunking: ChunkSizer = self._build_chunk_sizer()
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.sizing.page_size, self.chunking,
                                   StopRule(self.sizing.eos_token_ids, self.sizing.max_model_len),
                                   prefix_caching=config.cache.enable_prefix_caching)
        self.warmup_seconds = self.executor.warmup(self.sizing.shape)
        self.chunking.run_startup_sweep(self.executor.time_attention_free_forward)
        self._compilations_at_warmup = self.executor.num_compilations()
        self._frozen = device is not None if freeze_heap is None else freeze_heap
        if self._frozen:  # a full GC pass over start-up's objects stalled every stream (jaxcpp.gc_heap)
            freeze_startup_heap()
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: InFlight[tuple[SchedulerOutput, int]] = InFlight(
            self.executor.max_in_flight + self.async_scheduling)  # (step, ticket)
        self._aborted: list[RequestOutput] = []
        self._phases = PhaseRecorder()
        self._seed_rng = random.Random(config.model.seed)
        self._stats = StatsLogger(config.scheduler.log_stats_interval_s)
        log.info("engine ready: %d buckets %s compiled in %.1fs, %d KV pages of %d tokens (+1 reserved "
                 "padding page) in %s",
                 len(self.sizing.shape.buckets), self.sizing.shape.buckets, self.warmup_seconds,
                 self.allocator.num_usable, self.sizing.page_size, self.sizing.kv_cache_dtype)

    def _build_chunk_sizer(self) -> ChunkSizer:
        if not self.config.chunking.enable_dynamic_chunking:
            return FixedChunkSizer()
        return DynamicChunkController.from_config(self.config, allowed_sizes=tuple(self.sizing.token_buckets),
                                                  max_model_len=self.sizing.max_model_len)

    def close(self) -> None:
        """Release the executor (its threads, trace file, devices) and the frozen heap. Idempotent."""
        self.executor.close()
        self._phases.close()
        if self._frozen:
            thaw()
            self._frozen = False

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, group: str | None = None) -> None:
        """`group`: the samples of one prompt (n > 1) share one id here, so they share one prefill."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, self.sizing, self.config.scheduler)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        seq = Sequence(request_id, token_ids, params, seed,
                       RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
                       banned_ids=self._banned_ids(params), group=group)
        self.scheduler.add(seq)

    def _banned_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The stop ids min_tokens keeps the device from sampling (EOS unless ignored, stop_token_ids)."""
        if params.min_tokens == 0:
            return ()
        eos = () if params.ignore_eos else self.sizing.eos_token_ids
        banned = tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
        if len(banned) > MAX_BANNED_IDS:
            raise InvalidRequestError("stop_token_ids", f"with min_tokens, at most {MAX_BANNED_IDS} stop ids "
                                      f"(EOS included) can be held back; got {len(banned)}")
        return banned

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model folder has no tokenizer.json: send token ids")
        return self.tokenizer.encode(prompt)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request now and free its pages; `reason` "stop" when the edge matched a stop string."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return
        self.scheduler.finish(seq, reason, time.monotonic())
        self._aborted.append(self._output(seq, []))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self._in_flight or self._aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Submit the next step while the pipe has room; collect the oldest when it is full or idle."""
        start = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        submitted = collect = False
        try:
            submitted = self._pipe_has_room() and self._submit_next()
            collect = bool(self._in_flight) and (not self._pipe_has_room() or not submitted)
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
            self._stats.log(self.stats(), self.chunking.report())

    def _pipe_has_room(self) -> bool:
        return self._in_flight.has_room()

    def _submit_next(self) -> bool:
        oldest = self._in_flight.oldest if self.async_scheduling and self._in_flight else None
        phase = self._phases.timer(self.scheduler.num_steps)
        with phase("schedule"):
            sched = self.scheduler.schedule(feedback_from=oldest[0].step_id if oldest else None)
        if sched.is_empty:
            return False
        with phase("build"):
            step = build_step_input(sched, self.sizing.shape)
        try:
            with phase("dispatch"):
                ticket = self.executor.submit(step, want_tokens=sched.samples, want_logits=self.record_logits,
                                              ack=sched.ack,
                                              feedback_from=oldest[1] if oldest and sched.feeds_back else None,
                                              want_logprobs=sched.wants_logprobs,
                                              want_prompt_logprobs=sched.wants_prompt_logprobs)
        except ExecutorError:
            self._in_flight.append((sched, -1), sched.samples)  # never submitted: fails with those in flight
            raise
        self._in_flight.append((sched, ticket), sched.samples)
        self.scheduler.publish_written_pages(sched)  # submitted: later steps may read what it writes
        self._stats.count_scheduled(sched)
        return True

    def _collect_oldest(self) -> list[RequestOutput]:
        sched, ticket = self._in_flight.oldest  # taken off only once collected: a failure keeps it
        phase = self._phases.timer(sched.step_id)
        try:
            with phase("wait"):
                result = self.executor.collect(ticket)
            self._check_tokens(sched, result)
        except ExecutorError:
            self._in_flight.replace_oldest((sched, -1))  # the executor holds nothing more of it
            raise
        self._in_flight.popleft()
        with phase("postprocess"):
            sampled = self.scheduler.postprocess(sched, result, time.monotonic())
            self._stats.count_sampled(len(sampled))
            return [self._output(seq, seq.output_token_ids[-1:]) for seq in sampled]

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
        while self._in_flight:
            sched, ticket = self._in_flight.popleft()
            if ticket >= 0 and not error.fatal:
                self._discard(ticket)  # the executor keeps running: take back what it still holds
            for chunk in sched.chunks:
                if not chunk.seq.is_finished:
                    self.scheduler.finish(chunk.seq, "error", now)
                    outputs.append(dataclasses.replace(self._output(chunk.seq, []), error=str(error)))
        if error.fatal:
            raise error
        return outputs

    def _discard(self, ticket: int) -> None:
        try:
            self.executor.collect(ticket)
        except ExecutorError as e:
            log.error("a step in flight with the failed one failed too: %s", e)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        p = seq.params
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), new_token_ids,
                             seq.is_finished, seq.finish_reason, seq.metrics,
                             logits=seq.logits or None, num_cached_tokens=seq.num_cached_tokens,
                             logprobs=list(seq.logprobs) if p.logprobs is not None else None,
                             prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None)

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pages_used=self.allocator.num_used, num_pages_free=self.allocator.num_free,
            num_pages_total=self.allocator.num_usable,
            num_compilations_since_warmup=self.executor.num_compilations() - self._compilations_at_warmup,
            num_prompt_tokens_total=self._stats.prompt_tokens_total,
            num_generation_tokens_total=self._stats.generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            dynamic_chunking=self.chunking.stats(),
            num_prefix_cache_queried_tokens_total=self.scheduler.prefix_queried_tokens,
            num_prefix_cache_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            num_pages_cached=self.allocator.num_cached,
            num_prefix_cache_evictions_total=self.allocator.num_evictions)

    def model_info(self) -> ModelInfo:
        c, m = self.config, self.sizing.spec.config
        return ModelInfo(self.sizing.spec.name, m.architecture, m.vocab_size, self.sizing.max_model_len,
                         m.num_hidden_layers, m.hidden_size, m.dtype, self.sizing.page_size,
                         c.scheduler.max_num_batched_tokens, c.parallel.pipeline_parallel_size,
                         c.parallel.tensor_parallel_size, self.sizing.eos_token_ids, self.sizing.kv_cache_dtype)


def check_request(token_ids: list[int], params: SamplingParams, sizing: EngineSizing,
                  scheduler: SchedulerConfig) -> None:
    """Refuse a request the engine cannot run, naming the field (`InvalidRequestError`). Needs only the
    sizing, so `jaxcpp generate` checks its prompt before it loads the model and compiles."""
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


class PhaseRecorder:
    """The engine loop's own time, phase by phase (`HostPhase`), handed to the executor's trace, and the
    garbage collector's pauses as phase "gc" of the step being timed (every thread waits for those)."""

    def __init__(self) -> None:
        self._done: list[HostPhase] = []
        self._step = 0
        self._gc = GcWatch(lambda start, end: self._done.append(HostPhase("gc", self._step, start, end)))

    def timer(self, step: int) -> Callable[[str], AbstractContextManager[None]]:
        """`with timer("build"): ...` records that phase of step `step`."""
        self._step = step

        @contextmanager
        def phase(name: str) -> Iterator[None]:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._done.append(HostPhase(name, step, start, time.perf_counter()))

        return phase

    def take(self) -> list[HostPhase]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._gc.close()


def _device_side() -> Any:
    """The device side (`jaxcpp.runtime.factory`), imported here so that importing the engine never
    imports jax: only building the real executor does."""
    from jaxcpp.runtime import factory

    return factory
