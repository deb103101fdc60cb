"""Configuration: frozen dataclasses, one per owner, that check their values where they are built.

    fields.py       opt (a field and its flag's help), require (errors name the flag), ConfigError
    model.py        ModelConfig (the weights, dtype, attention), CacheConfig (KV pages, fp8 pages)
    scheduling.py   SchedulerConfig (the step's budget), ChunkingConfig (dynamic chunking)
    parallel.py     ParallelConfig (stages, devices, one host or several, stand-in stages)
    kv_transfer.py  KVTransferConfig (disaggregation's flags) -> KVSettings (this instance's role)
    server.py       ServerConfig (both front ends, limits, TLS, the API key)
    engine.py       EngineConfig (the engine's sections together), DEPRECATED_ALIASES

Each field's `metadata["help"]` becomes the help of the CLI flag of the same name (underscores become
dashes), so the flags and the config cannot drift apart (`jaxcpp.cli_args`). Errors name the flag.

Pure values: nothing here reads the environment, checks a file or logs. The command line fills flags left
out from the environment (`jaxcpp.cli_args`); the server reads its TLS and key files at start-up
(`serving/security.py`); the edges that build an engine's config log its `startup_warnings()`.
Host-side: no jax here.
"""

from jaxcpp.config.engine import DEPRECATED_ALIASES, ENGINE_SECTIONS, EngineConfig, resolve_alias
from jaxcpp.config.fields import ConfigError, flag_name, opt, require
from jaxcpp.config.kv_transfer import KV_CONNECTOR, KV_ROLES, KVSettings, KVTransferConfig, produces
from jaxcpp.config.model import FP8_KV_DTYPES, KV_CACHE_DTYPES, CacheConfig, ModelConfig
from jaxcpp.config.parallel import ParallelConfig
from jaxcpp.config.scheduling import DEFAULT_SMOOTH_FACTOR, SMOOTH_FACTOR_ENV, ChunkingConfig, SchedulerConfig
from jaxcpp.config.server import API_KEY_ENV, ServerConfig

__all__ = [
    "API_KEY_ENV", "DEFAULT_SMOOTH_FACTOR", "DEPRECATED_ALIASES", "ENGINE_SECTIONS", "FP8_KV_DTYPES",
    "KV_CACHE_DTYPES", "KV_CONNECTOR", "KV_ROLES", "SMOOTH_FACTOR_ENV", "CacheConfig", "ChunkingConfig",
    "ConfigError", "EngineConfig", "KVSettings", "KVTransferConfig", "ModelConfig", "ParallelConfig",
    "SchedulerConfig", "ServerConfig", "flag_name", "opt", "produces", "require", "resolve_alias",
]
