"""How steps are filled: the scheduler's budget (`SchedulerConfig`) and dynamic chunking (`ChunkingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxcpp.config.fields import opt, require

DEFAULT_SMOOTH_FACTOR = 0.75  # the one default of --dynamic-chunking-smooth-factor (ChunkSettings uses it)
SMOOTH_FACTOR_ENV = "JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR"  # read by the command line (jaxcpp.cli_args)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = opt(512, "token budget of one step; with chunked prefill also the "
                                      "largest prompt chunk")
    max_num_seqs: int = opt(64, "most sequences in one step")
    enable_chunked_prefill: bool = opt(True, "split prompts into chunks that share steps with decodes")
    log_stats_interval_s: float = opt(10.0, "seconds between engine-status log lines while the engine works; their "
                                          "rates are over its busy time (0: never)")
    async_scheduling: bool = opt(True, "schedule step k+1 while step k runs; decodes take their input "
                                 "token on the device (--no-async-scheduling: wait for every step)")

    def __post_init__(self) -> None:
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(self.max_num_seqs <= self.max_num_batched_tokens, "max_num_seqs",
               f"({self.max_num_seqs}) must not exceed --max-num-batched-tokens "
               f"({self.max_num_batched_tokens}): every sequence takes at least one token")


@dataclass(frozen=True)
class ChunkingConfig:
    enable_dynamic_chunking: bool = opt(False, "size each prompt chunk from a fitted latency model so "
                                        "pipeline micro-batches take equal time (needs PP > 1)")
    dynamic_chunking_smooth_factor: float = field(
        default=DEFAULT_SMOOTH_FACTOR,
        metadata={"help": "0 = fixed chunks, 1 = the solved equal-latency chunk "
                          f"(default: env {SMOOTH_FACTOR_ENV}, else {DEFAULT_SMOOTH_FACTOR})"})
    dynamic_chunking_min_chunk_size: int = opt(4096, "smallest chunk the solver may choose")
    dynamic_chunking_policy: str = opt("equal-latency", "equal-latency (ATOM's rule) or optimal "
                                       "(plan all chunks to minimise predicted TTFT)",
                                       choices=("equal-latency", "optimal"))

    def __post_init__(self) -> None:
        require(0.0 <= self.dynamic_chunking_smooth_factor <= 1.0, "dynamic_chunking_smooth_factor",
               f"must be in [0, 1], got {self.dynamic_chunking_smooth_factor}")
        require(self.dynamic_chunking_min_chunk_size >= 1, "dynamic_chunking_min_chunk_size", "must be >= 1")
