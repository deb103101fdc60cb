"""A deterministic stand-in for `jaxcpp.engine.LLMEngine` (no jax), for fast gRPC tests.

Same interface and the same contracts the server relies on: validation with `InvalidRequestError`,
decodes first then prompt chunks within `max_num_batched_tokens`, pages allocated per request and
freed on finish or abort, an aborted request yields a final output with finish_reason "abort", `text`
is filled only once a request finishes.
Tokens are bytes (vocab 256 + EOS); each generated token depends only on the prompt and its position,
so outputs are reproducible. `step_delay_s` slows steps down to make cancellation races testable.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from jaxcpp.errors import InvalidRequestError
from jaxcpp.outputs import EngineStats, ModelInfo, RequestMetrics, RequestOutput
from jaxcpp.sampling_params import SamplingParams

EOS = 256


class FakeTokenizer:
    """UTF-8 bytes as token ids; EOS decodes to nothing."""

    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    num_pages: int
    num_computed: int = 0
    output: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, *, max_model_len: int = 512, block_size: int = 16, num_pages: int = 256,
                 max_num_batched_tokens: int = 64, step_delay_s: float = 0.0,
                 eos_after: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_pages = num_pages
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_delay_s = step_delay_s
        self.eos_after = eos_after                # emit EOS as the n-th token (None: never)
        self.dynamic_chunking: dict[str, object] = {"state": "off"}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._aborted: list[_Request] = []
        self._pages_used = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0

    # -- the LLMEngine interface ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError("prompt_token_ids",
                                      f"token ids must be in [0, {self.tokenizer.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) "
                                      f"exceeds max_model_len ({self.max_model_len})")
        if any(r.request_id == request_id for r in self._waiting + self._running):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        pages = math.ceil((len(ids) + params.max_tokens) / self.block_size)
        self._waiting.append(_Request(request_id, ids, params, RequestMetrics(time.monotonic()), pages))

    def abort_request(self, request_id: str) -> None:
        for queue in (self._waiting, self._running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    if queue is self._running:
                        self._pages_used -= req.num_pages
                    self._aborted.append(req)
                    return

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = [self._finish(req, "abort", []) for req in self._aborted]
        self._aborted.clear()
        self._admit()
        budget = self.max_num_batched_tokens
        for req in list(self._running):             # decodes first, one token each
            if req.num_computed >= len(req.prompt) and budget > 0:
                budget -= 1
                outputs.append(self._emit(req))
        for req in list(self._running):             # then prompt chunks
            remaining = len(req.prompt) - req.num_computed
            if remaining > 0 and budget > 0:
                chunk = min(remaining, budget)
                req.num_computed += chunk
                budget -= chunk
                self._prompt_tokens += chunk
                if req.num_computed == len(req.prompt):
                    outputs.append(self._emit(req))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting),
                           num_pages_used=self._pages_used, num_pages_free=self.num_pages - self._pages_used,
                           num_pages_total=self.num_pages, num_compilations_since_warmup=0,
                           num_prompt_tokens_total=self._prompt_tokens,
                           num_generation_tokens_total=self._generated_tokens, num_preemptions_total=0,
                           dynamic_chunking=dict(self.dynamic_chunking))

    def model_info(self) -> ModelInfo:
        return ModelInfo(name="fake", architecture="fake", vocab_size=self.tokenizer.vocab_size,
                         max_model_len=self.max_model_len, num_layers=1, hidden_size=8, dtype="float32",
                         block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                         pipeline_parallel_size=1, tensor_parallel_size=1, eos_token_ids=(EOS,))

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def expected_tokens(prompt: list[int], n: int) -> list[int]:
        """The tokens this engine generates for `prompt` (printable ASCII), before any stop."""
        seed = sum(prompt) * 131 + len(prompt)
        return [32 + (seed + 17 * i) % 95 for i in range(n)]

    def _admit(self) -> None:
        while self._waiting and self._pages_used + self._waiting[0].num_pages <= self.num_pages:
            req = self._waiting.pop(0)
            self._pages_used += req.num_pages
            self._running.append(req)

    def _emit(self, req: _Request) -> RequestOutput:
        n = len(req.output)
        token = EOS if self.eos_after is not None and n + 1 == self.eos_after else \
            self.expected_tokens(req.prompt, n + 1)[n]
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        else:
            assert req.metrics.last_token_time is not None
            req.metrics.itl.append(now - req.metrics.last_token_time)
        req.metrics.last_token_time = now
        req.output.append(token)
        self._generated_tokens += 1
        stop = (token == EOS and not req.params.ignore_eos) or token in req.params.stop_token_ids
        if stop or len(req.output) >= req.params.max_tokens:
            self._running.remove(req)
            self._pages_used -= req.num_pages
            return self._finish(req, "stop" if stop else "length", [token])
        return self._output(req, [token], False, None)

    def _finish(self, req: _Request, reason: str, new: list[int]) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        return self._output(req, new, True, reason)

    def _output(self, req: _Request, new: list[int], finished: bool, reason: str | None) -> RequestOutput:
        text = self.tokenizer.decode(req.output) if finished else ""  # like LLMEngine: text once finished
        return RequestOutput(req.request_id, req.prompt, list(req.output), new, finished, reason, req.metrics,
                             text=text)
