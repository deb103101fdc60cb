"""What the engine hands back: per-request outputs and metrics, engine stats, model info (host side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    arrival_time: float                   # time.monotonic() when the request was added
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    itl: list[float] = field(default_factory=list)  # seconds between consecutive output tokens

    def record_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.itl.append(now - self.last_token_time)
        self.last_token_time = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability under the model's raw logits, and the most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k asked for: (token id, logprob), most likely first


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # every token generated so far
    new_token_ids: list[int]              # the tokens this step added
    finished: bool
    finish_reason: str | None             # "stop" (EOS or a stop id), "length", "abort", "error"; None while running
    metrics: RequestMetrics
    text: str = ""                        # the text (LLM.generate; the engine leaves it to the edge)
    logits: list[Any] | None = None       # [V] float32 per sampled token, when the engine records them (tests)
    error: str | None = None              # what failed, when finish_reason is "error"
    num_cached_tokens: int = 0            # prompt tokens whose K/V came from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # per prompt token but the first, once all are scored
    samples: list[RequestOutput] | None = None  # LLM.generate with n > 1: all n samples (this is the first)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_free: int
    num_pages_total: int
    num_compilations_since_warmup: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    dynamic_chunking: dict[str, Any] = field(default_factory=dict)  # state and counters, once enabled
    # Prefix caching: prompt tokens looked up at admission and found (first admissions only), cached
    # pages (registered, held by nobody; counted in num_pages_free since they are evicted on demand).
    num_prefix_cache_queried_tokens_total: int = 0
    num_prefix_cache_hit_tokens_total: int = 0
    num_pages_cached: int = 0
    num_prefix_cache_evictions_total: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start (0 before any query)."""
        queried = self.num_prefix_cache_queried_tokens_total
        return self.num_prefix_cache_hit_tokens_total / queried if queried else 0.0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    dtype: str
    page_size: int
    max_num_batched_tokens: int
    pipeline_parallel_size: int
    tensor_parallel_size: int
    eos_token_ids: tuple[int, ...]
    kv_cache_dtype: str = ""  # what the KV pages hold: the model's dtype, float8_e4m3fn or float8_e5m2
