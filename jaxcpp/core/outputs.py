"""What the engine hands back: per-request outputs and metrics, engine stats, model info (host side)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
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
    """What one step did to one request: what is new, not everything so far (a stream of n tokens is
    n outputs, so a copy of all tokens in each would cost n² in all). The finished output also
    carries every generated token, once."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # every token generated, on the finished output only ([] before)
    new_token_ids: list[int]              # the tokens this step added
    finished: bool
    finish_reason: str | None             # "stop" (EOS or a stop id), "length", "abort", "error"; None while running
    metrics: RequestMetrics
    text: str = ""                        # the text (LLM.generate; the engine leaves it to the edge)
    logits: list[Any] | None = None       # [V] float32 per sampled token, when the engine records them (tests)
    error: str | None = None              # what failed, when finish_reason is "error"
    unavailable: bool = False             # ... because a service it needs is down now (no producer could
                                          # prefill it): the front ends answer UNAVAILABLE / 503, retryable
    num_cached_tokens: int = 0            # prompt tokens whose K/V came from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # of new_token_ids, when asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # per prompt token but the first: on the first
                                                        # output and the finished one (when asked)
    samples: list[RequestOutput] | None = None  # LLM.generate with n > 1: all n samples (this is the first)
    num_generated: int = 0                # tokens generated so far, new_token_ids included
    kv_offer: Any = None                  # a producer's finished output: where its KV pages wait (KVOffer)


def _count(metric: str = "", doc: str = "", default: int | None = None) -> Any:
    """An EngineStats count, and the Prometheus metric it is exported as (a count whose name ends in
    _total is a counter, the others gauges; no metric name: not exported on its own)."""
    metadata = {"metric": metric, "doc": doc}
    return field(metadata=metadata) if default is None else field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineStats:
    """The engine's counts: one schema for the gRPC message (its fields have these names), the client
    (`from_counts`) and the metrics (each field's metric name and help text)."""

    num_running: int = _count("jaxcpp_requests_running", "requests the engine is running")
    num_waiting: int = _count("jaxcpp_requests_waiting", "requests in the engine waiting for pages")
    num_pages_used: int = _count("jaxcpp_kv_cache_pages_used", "KV-cache pages in use")
    num_pages_free: int = _count("jaxcpp_kv_cache_pages_free", "KV-cache pages free")
    num_pages_total: int = _count()
    num_compilations_since_warmup: int = _count("jaxcpp_compilations_since_warmup",
                                                "XLA compilations after warm-up (should stay 0)")
    num_prompt_tokens_total: int = _count("jaxcpp_prompt_tokens", "prompt tokens processed")
    num_generation_tokens_total: int = _count("jaxcpp_generation_tokens", "tokens generated")
    num_preemptions_total: int = _count("jaxcpp_preemptions", "requests preempted")
    dynamic_chunking: dict[str, Any] = field(default_factory=dict)  # state and counters, once enabled
    # Prefix caching: prompt tokens looked up at admission and found (first admissions only), cached
    # pages (registered, held by nobody; counted in num_pages_free since they are evicted on demand).
    num_prefix_cache_queried_tokens_total: int = _count("jaxcpp_prefix_cache_queries",
                                                        "prompt tokens looked up in the prefix cache", 0)
    num_prefix_cache_hit_tokens_total: int = _count("jaxcpp_prefix_cache_hits",
                                                    "prompt tokens the prefix cache supplied", 0)
    num_pages_cached: int = _count("jaxcpp_kv_cache_pages_cached", "KV-cache pages holding a cached prefix "
                                   "nobody holds (evictable; counted as free)", 0)
    num_prefix_cache_evictions_total: int = _count("jaxcpp_prefix_cache_evictions", "cached KV pages evicted", 0)
    # Disaggregation, a consumer's side: what it pulled from producers, and how long that took.
    num_kv_transfers_total: int = _count("jaxcpp_kv_transfers", "prompts whose KV pages were pulled from a producer", 0)
    num_kv_transfer_bytes_total: int = _count("jaxcpp_kv_transfer_bytes", "bytes of KV pages pulled", 0)
    num_kv_transfer_tokens_total: int = _count("jaxcpp_kv_transfer_tokens", "prompt tokens whose KV was pulled", 0)
    num_kv_transfer_microseconds_total: int = _count("jaxcpp_kv_transfer_microseconds",
                                                     "time from a producer's offer to the pages' arrival", 0)
    num_remote_prefill_microseconds_total: int = _count("jaxcpp_remote_prefill_microseconds",
                                                        "time of the producers' prefill calls", 0)

    @staticmethod
    def count_fields() -> tuple[Field[Any], ...]:
        """Every count (all fields but dynamic_chunking), in declaration order."""
        return tuple(f for f in fields(EngineStats) if f.name != "dynamic_chunking")

    def counts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in self.count_fields()}

    @staticmethod
    def from_counts(source: Any, dynamic_chunking: dict[str, Any]) -> EngineStats:
        """From anything with the counts as attributes (the gRPC message)."""
        return EngineStats(**{f.name: getattr(source, f.name) for f in EngineStats.count_fields()},
                           dynamic_chunking=dynamic_chunking)

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
    kv_role: str = ""         # its part in disaggregation: kv_producer, kv_consumer, kv_both, "" (none)
    kv_layout: Any = None     # what its KV pages hold (KVLayout): a consumer checks a producer's against its own
