"""The engine's whole config (`EngineConfig`), its sections by name (`ENGINE_SECTIONS`) and the old flag
names that keep working (`DEPRECATED_ALIASES`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from jaxcpp.config.fields import ConfigError, flag_name, require
from jaxcpp.config.kv_transfer import KVTransferConfig
from jaxcpp.config.model import CacheConfig, ModelConfig
from jaxcpp.config.parallel import ParallelConfig
from jaxcpp.config.scheduling import ChunkingConfig, SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        kv = self.kv_transfer.settings()
        # calculated fp8 scales are each instance's own, from its first prefill: pages would cross with the wrong ones
        require(kv is None or not self.cache.calculate_kv_scales, "calculate_kv_scales",
                "cannot be used with --kv-transfer-config: producer and consumer must share the checkpoint's scales")
        if kv is not None and kv.consumes and self.kv_transfer.prefill_servers is not None:
            require(self.parallel.executor_backend == "inproc", "kv_transfer_config",
                    "a kv_consumer pulls KV pages into the stages of its own process: "
                    "--distributed-executor-backend inproc (the default on one host)")
        if self.dynamic_chunking:
            require(self.parallel.pipeline_parallel_size > 1, "enable_dynamic_chunking",
                    "needs --pipeline-parallel-size > 1")
            require(self.scheduler.enable_chunked_prefill, "enable_dynamic_chunking",
                    "needs chunked prefill (drop --no-enable-chunked-prefill)")

    def startup_warnings(self) -> list[str]:
        """What was asked for and is turned off, in words; the edges that build a config (the command line,
        `LLM`) log them."""
        if self.chunking.enable_dynamic_chunking and not self.dynamic_chunking:
            return ["--enable-dynamic-chunking is off on a kv_consumer: it decodes, the producers prefill "
                    "(turn it on there)"]
        return []

    @property
    def dynamic_chunking(self) -> bool:
        """--enable-dynamic-chunking, but never on a kv_consumer, which does not prefill (as ATOM: off, warned)."""
        kv = self.kv_transfer.settings()
        return self.chunking.enable_dynamic_chunking and not (kv is not None and kv.only_consumes)

    @staticmethod
    def from_kwargs(**kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments named like the CLI flags (`max_num_batched_tokens=512`)."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in ENGINE_SECTIONS}
        owners = {fld.name: name for name, cls in ENGINE_SECTIONS.items() for fld in dataclasses.fields(cls)}
        for key, value in kwargs.items():
            key = resolve_alias(key)
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}")
            sections[owners[key]][key] = value
        return EngineConfig(**{name: ENGINE_SECTIONS[name](**vals) for name, vals in sections.items()})


# Old names that keep working, with a warning: vLLM's "block" is our "page".
DEPRECATED_ALIASES = {"block_size": "page_size"}


def resolve_alias(name: str) -> str:
    new = DEPRECATED_ALIASES.get(name)
    if new is None:
        return name
    # FutureWarning, not DeprecationWarning: Python shows it by default (it hid the other from CLI users)
    warnings.warn(f"{flag_name(name)} is deprecated: use {flag_name(new)}", FutureWarning, stacklevel=3)
    return new


ENGINE_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "parallel": ParallelConfig, "chunking": ChunkingConfig, "kv_transfer": KVTransferConfig,
}
