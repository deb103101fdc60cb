"""The engine loop: schedule -> submit -> collect -> postprocess.

The engine owns the host state (requests, pages, scheduler) and talks to the model only through an
executor's `submit`/`collect`. With a pipeline of P stages up to P steps are in flight: the loop
keeps submitting while the pipe has room and something can be scheduled, and collects the oldest step
when the pipe is full or there is nothing new to send. Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import deque

from jaxcpp.chunking.controller import DynamicChunkController
from jaxcpp.config import EngineConfig
from jaxcpp.errors import InvalidRequestError
from jaxcpp.outputs import EngineStats, ModelInfo, RequestMetrics, RequestOutput
from jaxcpp.page_allocator import PageAllocator
from jaxcpp.runtime import compile_guard
from jaxcpp.runtime.executor import Executor, StepResult
from jaxcpp.runtime.factory import build_executor, load_model
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.scheduler import Scheduler, SchedulerOutput
from jaxcpp.sequence import Sequence
from jaxcpp.stats_logger import StatsLogger
from jaxcpp.step_input import StepShape, build_step_input

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, record_logits: bool = False) -> None:
        self.config = config
        self.record_logits = record_logits
        self.model = load_model(config)
        self.tokenizer = self.model.tokenizer
        self.page_size = config.cache.block_size
        self.executor: Executor = build_executor(config, self.model)
        self.allocator = PageAllocator(self.model.num_pages)
        self.shape = StepShape(self.model.token_buckets, config.scheduler.max_num_seqs,
                               self.model.pages_per_seq, self.page_size)
        self.chunking = self._build_chunk_controller()
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.page_size, self.chunking)
        self.warmup_seconds = self.executor.warmup(self.shape.token_buckets, self.shape.max_num_seqs,
                                                   self.shape.pages_per_seq)
        if self.chunking is not None:
            self.chunking.run_startup_sweep(self.executor.time_dummy_forward)
        self._compilations_at_warmup = compile_guard.num_compilations()
        self._requests: dict[str, Sequence] = {}
        self._in_flight: deque[tuple[SchedulerOutput, int]] = deque()
        self._aborted: list[RequestOutput] = []
        self._seed_rng = random.Random(config.model.seed)
        self._stats = StatsLogger(config.scheduler.log_stats_interval_s)
        log.info("engine ready: %d buckets %s compiled in %.1fs, %d KV pages of %d tokens (+1 reserved "
                 "padding page)", len(self.shape.token_buckets), self.shape.token_buckets, self.warmup_seconds,
                 self.allocator.num_usable, self.page_size)

    def _build_chunk_controller(self) -> DynamicChunkController | None:
        if not self.config.chunking.enable_dynamic_chunking:
            return None
        return DynamicChunkController.from_config(self.config, allowed_sizes=tuple(self.shape.token_buckets),
                                                  max_model_len=self.model.max_model_len)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        seq = Sequence(request_id, token_ids, params, seed,
                       RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()))
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model folder has no tokenizer.json: send token ids")
        return self.tokenizer.encode(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len, vocab = self.model.max_model_len, self.model.config.vocab_size
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
        budget = self.config.scheduler.max_num_batched_tokens
        if not self.config.scheduler.enable_chunked_prefill and len(token_ids) > budget:
            raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; without chunked prefill a "
                                      f"prompt must fit --max-num-batched-tokens {budget}")

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is None:
            return
        self._retire(seq, "abort", time.monotonic())
        self._aborted.append(self._output(seq, []))

    def _retire(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.request_id, None)
        seq.metrics.finished_time = now
        if self.chunking is not None:
            self.chunking.finish_request(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._in_flight or self._aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Submit the next step while the pipe has room; collect the oldest when it is full or idle."""
        outputs, self._aborted = self._aborted, []
        submitted = self._pipe_has_room() and self._submit_next()
        if self._in_flight and (not self._pipe_has_room() or not submitted):
            outputs += self._collect_oldest()
        self._stats.maybe_log(self)
        return outputs

    def _pipe_has_room(self) -> bool:
        return len(self._in_flight) < self.executor.max_in_flight

    def _collect_oldest(self) -> list[RequestOutput]:
        sched, ticket = self._in_flight.popleft()
        outputs = self._postprocess(sched, self.executor.collect(ticket))
        self._record_chunk_timing(sched, ticket)
        return outputs

    def _submit_next(self) -> bool:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return False
        wait = self.chunking is not None and self.chunking.head_waits_for_ack
        ticket = self.executor.submit(build_step_input(sched, self.shape), wait_for_last_stage=wait)
        self._in_flight.append((sched, ticket))
        self._stats.count_scheduled(sched)
        return True

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        logits = result.logits() if self.record_logits else None
        outputs = []
        for i, chunk in enumerate(sched.chunks):
            seq = chunk.seq
            if not chunk.samples or seq.is_finished:
                continue  # a middle prefill chunk, or a request aborted while its step was in flight
            token = int(result.tokens[i])
            seq.output_token_ids.append(token)
            seq.awaiting_token = False
            self._record_token_time(seq, now)
            if logits is not None:
                seq.logits.append(logits[i])
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._retire(seq, reason, now)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _record_chunk_timing(self, sched: SchedulerOutput, ticket: int) -> None:
        """Feed the calibration: a batch that is one prefill chunk alone, timed on the device."""
        if self.chunking is None or self.chunking.state != "calibrating" or len(sched.chunks) != 1:
            return
        chunk = sched.chunks[0]
        if chunk.start >= len(chunk.seq.prompt_token_ids):
            return  # a decode
        seconds = self.executor.forward_time(ticket)
        if seconds is None:
            return
        self.chunking.record_timing(chunk.num_tokens, chunk.start, seconds, True, chunk.seq.request_id)

    @staticmethod
    def _record_token_time(seq: Sequence, now: float) -> None:
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.itl.append(now - m.last_token_time)
        m.last_token_time = now

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.model.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), new_token_ids,
                             seq.is_finished, seq.finish_reason, seq.metrics,
                             self._final_text(seq),
                             logits=seq.logits or None)

    def _final_text(self, seq: Sequence) -> str:
        """Detokenize once, at the end; streaming callers use `IncrementalDetokenizer` per step."""
        if not seq.is_finished or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids)

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pages_used=self.allocator.num_used, num_pages_free=self.allocator.num_free,
            num_pages_total=self.allocator.num_usable,
            num_compilations_since_warmup=compile_guard.num_compilations() - self._compilations_at_warmup,
            num_prompt_tokens_total=self._stats.prompt_tokens_total,
            num_generation_tokens_total=self._stats.generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            dynamic_chunking=self._chunking_state())

    def _chunking_state(self) -> dict[str, object]:
        if self.chunking is None:
            return {"state": "off"}
        model = self.chunking.model
        coeffs = {} if model is None else dataclasses.asdict(model)
        return {"state": self.chunking.state, "policy": self.chunking.policy, **coeffs}

    def model_info(self) -> ModelInfo:
        c, m = self.config, self.model
        return ModelInfo(m.name, m.config.architecture, m.config.vocab_size, m.max_model_len,
                         m.config.num_hidden_layers, m.config.hidden_size, m.dtype_name, self.page_size,
                         c.scheduler.max_num_batched_tokens, c.parallel.pipeline_parallel_size,
                         c.parallel.tensor_parallel_size, tuple(m.eos_token_ids))
