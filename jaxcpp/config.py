"""Engine configuration: frozen dataclasses split by owner, validated where they are built.

Each field's `metadata["help"]` becomes the help of the CLI flag of the same name (underscores become
dashes), so the flags and the config cannot drift apart (see `jaxcpp.cli_args`). Errors name the flag.
Host-side: no jax here.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from jaxcpp.chunking.latency_model import LatencyModel

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{_flag(name)}: {message}")


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with CLI help text."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("tiny", "model: 'tiny' (bundled), a Hugging Face folder (config.json + safetensors) "
                     "or an orbax checkpoint folder written by jaxcpp")
    dtype: str = opt("auto", "parameter/activation dtype: auto (the checkpoint's; float32 on the CPU backend, "
                     "where bfloat16 is emulated), float32, bfloat16, float16",
                     choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = opt(None, "longest prompt + output, in tokens (default: the model's)")
    seed: int = opt(0, "seed for parameter init of random models and for unseeded sampling")
    attention_backend: str = opt("auto", "attention implementation: auto (Pallas on GPU, XLA on CPU), "
                                 "pallas, xla", choices=("auto", "pallas", "xla"))
    quantization: str | None = opt(None, "fp8: quantize a float checkpoint's decoder-layer weights to float8_e4m3 "
                                   "at load, one scale per output channel (checkpoints stored in fp8 load as "
                                   "fp8 without it); matmuls dequantize on the fly", choices=("fp8",))

    def __post_init__(self) -> None:
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _require(self.quantization in (None, "fp8"), "quantization", f"must be fp8, got {self.quantization!r}")


# vLLM's --kv-cache-dtype names -> the dtype the pages hold ("fp8" is e4m3, as on CUDA). The "fn" e4m3 (no
# infinities, max 448) is the OCP format H100/H200 and MI355 store; MI300's "fnuz" variant is not offered.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = opt(16, "tokens per KV-cache page (--block-size is a deprecated alias)")
    num_pages: int | None = opt(None, "KV-cache pages per stage, the reserved page 0 included "
                                "(default: sized from --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = opt(1.0, "memory for the KV cache when --num-pages is not given")
    enable_prefix_caching: bool = opt(True, "reuse the KV pages of prompt prefixes computed before "
                                      "(whole pages, hashed; evicted least-recently-used when pages run out)")
    kv_cache_dtype: str = opt("auto", "KV-cache page dtype: auto (the model's), fp8 (= fp8_e4m3), fp8_e4m3, "
                              "fp8_e5m2: 8-bit pages with a K and a V scale per layer (the checkpoint's "
                              "k_scale/v_scale, else 1.0), twice the pages of bfloat16 in the same memory",
                              choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = opt(False, "with an fp8 --kv-cache-dtype: set each layer's K and V scale from "
                                    "the first prefill step's largest |K| and |V| (instead of the "
                                    "checkpoint's or 1.0)")

    def __post_init__(self) -> None:
        _require(self.page_size >= 1 and (self.page_size & (self.page_size - 1)) == 0, "page_size",
                 f"must be a power of two, got {self.page_size}")
        _require(self.num_pages is None or self.num_pages >= 2, "num_pages", "must be >= 2")
        _require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _require(not self.calculate_kv_scales or self.is_fp8, "calculate_kv_scales",
                 f"needs an fp8 --kv-cache-dtype, got {self.kv_cache_dtype!r}")

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def resolved_kv_cache_dtype(self, model_dtype: str) -> str:
        """The dtype the pages hold, by its numpy/ml_dtypes name ("float8_e4m3fn", or the model's dtype)."""
        return FP8_KV_DTYPES.get(self.kv_cache_dtype, model_dtype)


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
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_num_seqs <= self.max_num_batched_tokens, "max_num_seqs",
                 f"({self.max_num_seqs}) must not exceed --max-num-batched-tokens "
                 f"({self.max_num_batched_tokens}): every sequence takes at least one token")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = opt(1, "pipeline stages (mesh axis 'pp')")
    tensor_parallel_size: int = opt(1, "devices per stage (mesh axis 'tp')")
    pp_partition: str | None = opt(None, "layers per stage, comma-separated, e.g. 6,6,6,8 "
                                   "(default: even, extra layers on later stages)")
    trace_file: str | None = opt(None, "write per-stage timing probes as a Chrome/Perfetto trace JSON")
    distributed_executor_backend: str | None = opt(
        None, "inproc: every stage in this process; mp: one OS process per stage (default: mp when "
        "--num-processes > 1, else inproc)", choices=("inproc", "mp"))
    coordinator_address: str | None = field(default_factory=lambda: _env_coordinator(), metadata={
        "help": "host:port of the jax.distributed coordinator (stage 0's process, on the head's host) "
                "for a pipeline over several hosts; the head's control channel listens on port + 1 "
                "(default: env JAX_COORDINATOR_ADDRESS, else LWS_LEADER_ADDRESS:8476)"})
    num_processes: int | None = field(default_factory=lambda: _env_int("JAX_NUM_PROCESSES", "LWS_GROUP_SIZE"),
                                      metadata={"help": "processes (hosts) in the pipeline, one per stage "
                                                        "(default: env JAX_NUM_PROCESSES, else LWS_GROUP_SIZE)"})
    process_id: int | None = field(default_factory=lambda: _env_int("JAX_PROCESS_ID", "LWS_WORKER_INDEX"),
                                   metadata={"help": "this process's index: 0 is the head (engine, gRPC "
                                                     "and stage 0), I > 0 runs stage I (default: env "
                                                     "JAX_PROCESS_ID, else LWS_WORKER_INDEX)"})
    advertise_address: str | None = opt(None, "this host's IP address that the other hosts of a multi-host "
                                        "pipeline reach it at: its stage's transfer server binds and publishes "
                                        "it (default: the address of the interface that reaches the "
                                        "coordinator; under Kubernetes, the pod IP)")
    distributed_heartbeat_timeout_s: int = opt(
        100, "stage processes: seconds without a heartbeat after which jax.distributed's coordination service "
        "declares a stage dead and aborts every stage (jax's default); a stage that dies is noticed within "
        "milliseconds by its control connection closing, so this only has to outlast a stage starved of CPU "
        "(a busy node compiling)")

    stand_in_latency: str | None = opt(
        None, "benchmarks and load tests only: the stage processes run no model; each forward is a "
        "wait of t(L, x) = c + gamma*L + b*x + a*(2*L*x + x*x) seconds per stage, given as 'a,b,c,gamma', "
        "and its tokens are deterministic stand-ins; activations still cross the real hops "
        "(needs --distributed-executor-backend mp)")
    stand_in_jitter: float = opt(0.0, "with --stand-in-latency: relative standard deviation of a seeded "
                                 "random factor on each stand-in forward")

    def __post_init__(self) -> None:
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        self._check_distributed()
        self._check_stand_in()
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(self.distributed_heartbeat_timeout_s >= 1, "distributed_heartbeat_timeout_s",
                 f"must be >= 1, got {self.distributed_heartbeat_timeout_s}")
        if self.pp_partition is not None:
            parts = self.partition_list()
            _require(len(parts) == self.pipeline_parallel_size, "pp_partition",
                     f"gives {len(parts)} stages but --pipeline-parallel-size is {self.pipeline_parallel_size}")
            _require(all(p >= 1 for p in parts), "pp_partition", "every stage needs at least one layer")

    @property
    def executor_backend(self) -> str:
        """"mp" or "inproc": what `--distributed-executor-backend` asked for, or what the process count implies."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.is_multi_host else "inproc"

    @property
    def is_multi_host(self) -> bool:
        """Stage processes started separately (one `jaxcpp serve` per host), not spawned by the head."""
        return self.num_processes is not None and self.num_processes > 1

    def _check_distributed(self) -> None:
        n, pid = self.num_processes, self.process_id
        _require(n is None or n >= 1, "num_processes", f"must be >= 1, got {n}")
        if not self.is_multi_host:
            _require(pid in (None, 0), "process_id", f"is {pid} but --num-processes is {n or 1}")
            _require(self.advertise_address is None, "advertise_address",
                     "applies to a pipeline over several hosts (--num-processes > 1); on one host every "
                     "stage uses 127.0.0.1")
            return
        assert n is not None  # is_multi_host
        _require(self.distributed_executor_backend != "inproc", "distributed_executor_backend",
                 f"inproc runs every stage in one process; --num-processes {n} needs mp")
        _require(n == self.pipeline_parallel_size, "num_processes",
                 f"({n}) must equal --pipeline-parallel-size ({self.pipeline_parallel_size}): one process per stage")
        _require(pid is not None and 0 <= pid < n, "process_id", f"must be in [0, {n}), got {pid}")
        _require(self.coordinator_address is not None and ":" in self.coordinator_address,
                 "coordinator_address", f"host:port is needed with --num-processes {n}, got "
                 f"{self.coordinator_address!r}")
        if self.advertise_address is not None:
            try:
                ipaddress.ip_address(self.advertise_address)
            except ValueError:
                raise ConfigError(f"--advertise-address: an IP address of this host is needed (the transfer "
                                  f"server binds it), got {self.advertise_address!r}") from None

    def _check_stand_in(self) -> None:
        _require(self.stand_in_jitter >= 0, "stand_in_jitter", f"must be >= 0, got {self.stand_in_jitter}")
        if self.stand_in_latency is None:
            return
        _require(self.executor_backend == "mp", "stand_in_latency",
                 "runs in stage processes: add --distributed-executor-backend mp")
        try:
            model = LatencyModel.parse_coeffs(self.stand_in_latency)
        except ValueError:
            model = None
        _require(model is not None and min(model.a, model.b, model.c, model.gamma) >= 0, "stand_in_latency",
                 f"expects four numbers >= 0 'a,b,c,gamma' (seconds), got {self.stand_in_latency!r}")

    def stand_in_model(self) -> LatencyModel | None:
        """The latency model stand-in stages wait by, or None for a real device."""
        return None if self.stand_in_latency is None else LatencyModel.parse_coeffs(self.stand_in_latency)

    def partition_list(self) -> list[int]:
        assert self.pp_partition is not None
        try:
            return [int(p) for p in self.pp_partition.split(",")]
        except ValueError:
            raise ConfigError(f"--pp-partition: expected integers like 6,6,6,8, got {self.pp_partition!r}") from None


DEFAULT_SMOOTH_FACTOR = 0.75  # the one default of --dynamic-chunking-smooth-factor (ChunkSettings uses it)


def _env_int(*names: str) -> int | None:
    """The first of `names` set in the environment, as an int (JAX's variables first, then LWS's)."""
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}: expected an integer, got {value!r}") from None
    return None


def _env_coordinator() -> str | None:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return os.environ["JAX_COORDINATOR_ADDRESS"]
    leader = os.environ.get("LWS_LEADER_ADDRESS")
    return f"{leader}:8476" if leader else None


def _default_smooth_factor() -> float:
    value = os.environ.get("JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR", str(DEFAULT_SMOOTH_FACTOR))
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"environment variable JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR: expected a number, "
                          f"got {value!r}") from None


@dataclass(frozen=True)
class ChunkingConfig:
    enable_dynamic_chunking: bool = opt(False, "size each prompt chunk from a fitted latency model so "
                                        "pipeline micro-batches take equal time (needs PP > 1)")
    dynamic_chunking_smooth_factor: float = field(
        default_factory=_default_smooth_factor,
        metadata={"help": "0 = fixed chunks, 1 = the solved equal-latency chunk "
                          f"(default: env JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR, else {DEFAULT_SMOOTH_FACTOR})"})
    dynamic_chunking_min_chunk_size: int = opt(4096, "smallest chunk the solver may choose")
    dynamic_chunking_policy: str = opt("equal-latency", "equal-latency (ATOM's rule) or optimal "
                                       "(plan all chunks to minimise predicted TTFT)",
                                       choices=("equal-latency", "optimal"))

    def __post_init__(self) -> None:
        _require(0.0 <= self.dynamic_chunking_smooth_factor <= 1.0, "dynamic_chunking_smooth_factor",
                 f"must be in [0, 1], got {self.dynamic_chunking_smooth_factor}")
        _require(self.dynamic_chunking_min_chunk_size >= 1, "dynamic_chunking_min_chunk_size", "must be >= 1")


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTOR = "JaxTransferConnector"
# vLLM's other --kv-transfer-config keys, taken so that a vLLM deployment's JSON parses; they mean nothing here
# (a connection is made per producer stage on demand, from the addresses the producer hands out)
_VLLM_KV_KEYS_IGNORED = ("kv_rank", "kv_parallel_size", "kv_port", "kv_buffer_size", "kv_buffer_device", "engine_id")


@dataclass(frozen=True)
class KVSettings:
    """--kv-transfer-config, parsed: what this instance does in a disaggregated deployment."""

    role: str                     # kv_producer, kv_consumer or kv_both
    ip: str                       # the address its KV transfer servers bind and hand out
    transfer_timeout_s: float     # a consumer's wait for its pages; a producer's offer lives this long

    @property
    def produces(self) -> bool:
        return produces(self.role)

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def only_consumes(self) -> bool:
        """A kv_consumer: it never prefills (never chunks dynamically) and pulls into its own process."""
        return self.role == "kv_consumer"


def produces(role: str) -> bool:
    """Whether an instance with this kv_role (as its model info names it) prefills for consumers."""
    return role in ("kv_producer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_transfer_config: str | None = opt(
        None, "prefill-decode disaggregation, in vLLM's JSON form: {\"kv_role\": \"kv_producer\"} prefills for "
        "consumers, \"kv_consumer\" decodes what producers prefilled (with --prefill-servers), \"kv_both\" does "
        "either; optional: \"kv_connector\": \"JaxTransferConnector\" (the only one), \"kv_ip\": the address "
        "its KV transfer servers bind (default: env POD_IP, else 127.0.0.1), \"kv_connector_extra_config\": "
        "{\"transfer_timeout_s\": 60}")
    prefill_servers: str | None = opt(None, "a consumer's producers: gRPC host:port, comma-separated; a host name "
                                      "that resolves to several addresses (a headless Service) is that many "
                                      "producers")

    def __post_init__(self) -> None:
        settings = self.settings()  # parses, naming the bad key
        consumes = settings is not None and settings.consumes
        _require(self.prefill_servers is None or consumes, "prefill_servers",
                 "is for a consumer: add --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'")
        _require(self.prefill_servers is not None or settings is None or not settings.only_consumes,
                 "prefill_servers", "a kv_consumer needs the producers' addresses")
        for server in self.prefill_server_list():
            host, _, port = server.rpartition(":")
            _require(bool(host) and port.isdigit(), "prefill_servers", f"expected host:port, got {server!r}")

    def prefill_server_list(self) -> list[str]:
        return [s.strip() for s in (self.prefill_servers or "").split(",") if s.strip()]

    def settings(self) -> KVSettings | None:
        """The parsed --kv-transfer-config, or None when this instance is not disaggregated."""
        return self._parsed

    @functools.cached_property
    def _parsed(self) -> KVSettings | None:  # parsed once (a frozen dataclass keeps a cached_property)
        if self.kv_transfer_config is None:
            return None
        name = "kv_transfer_config"
        try:
            given = json.loads(self.kv_transfer_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{_flag(name)}: not JSON ({e}): {self.kv_transfer_config!r}") from None
        _require(isinstance(given, dict), name, f"expected a JSON object, got {self.kv_transfer_config!r}")
        known = {"kv_connector", "kv_role", "kv_ip", "kv_connector_extra_config", *_VLLM_KV_KEYS_IGNORED}
        unknown = sorted(set(given) - known)
        _require(not unknown, name, f"unknown key(s) {unknown}; known: {sorted(known)}")
        _require(given.get("kv_connector", KV_CONNECTOR) == KV_CONNECTOR, name,
                 f"kv_connector: only {KV_CONNECTOR!r} (KV pages over jax.experimental.transfer), got "
                 f"{given.get('kv_connector')!r}")
        role = given.get("kv_role")
        _require(role in KV_ROLES, name, f"kv_role: one of {', '.join(KV_ROLES)}, got {role!r}")
        ip = given.get("kv_ip") or os.environ.get("POD_IP") or "127.0.0.1"
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"{_flag(name)}: kv_ip: an IP address of this host is needed (its transfer "
                              f"servers bind it), got {ip!r}") from None
        extra = given.get("kv_connector_extra_config") or {}
        _require(isinstance(extra, dict) and set(extra) <= {"transfer_timeout_s"}, name,
                 f"kv_connector_extra_config: takes only transfer_timeout_s, got {extra!r}")
        timeout = extra.get("transfer_timeout_s", 60.0)
        _require(isinstance(timeout, (int, float)) and timeout > 0, name,
                 f"kv_connector_extra_config.transfer_timeout_s: seconds > 0, got {timeout!r}")
        return KVSettings(role, ip, float(timeout))


API_KEY_ENV = "JAXCPP_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to bind (both APIs); the default is loopback only")
    port: int = opt(50051, "gRPC port (0: pick a free one)")
    http_port: int = opt(8000, "OpenAI-compatible HTTP API port (0: pick a free one)")
    enable_grpc: bool = opt(True, "serve the gRPC API on --port (--no-enable-grpc: HTTP only)")
    enable_http: bool = opt(True, "serve the OpenAI-compatible HTTP API on --http-port (--no-enable-http: gRPC "
                            "only)")
    served_model_name: str | None = opt(None, "model name(s) the HTTP API answers to, comma-separated "
                                        "(default: --model as given)")
    chat_template: str | None = opt(None, "jinja2 chat template for /v1/chat/completions: a file, or the "
                                    "template itself (default: the model's tokenizer_config.json)")
    enable_auto_tool_choice: bool = opt(False, 'let chat requests use tool_choice "auto" (the model decides; '
                                        "calls parsed from its text by --tool-call-parser)")
    tool_call_parser: str | None = opt(None, "how tool calls are parsed from generated text for tool_choice "
                                       '"auto": hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>)')
    metrics_port: int | None = opt(None, "serve Prometheus metrics on this port (the HTTP API serves them "
                                   "at /metrics too)")
    max_queue_size: int = opt(256, "calls waiting or running, both APIs together, before RESOURCE_EXHAUSTED "
                              "(gRPC) or 429 (HTTP)")
    max_message_bytes: int = opt(4 * 1024 * 1024, "largest gRPC message accepted or sent, and largest HTTP "
                                 "request body (413 beyond)")
    max_prompt_bytes: int = opt(1024 * 1024, "largest text prompt, in UTF-8 bytes, checked before "
                                "tokenizing (INVALID_ARGUMENT, or HTTP 413, beyond)")
    max_stream_buffer: int = opt(256, "responses a call may hold for a client that is not reading, per sample "
                                 "of each prompt (n x prompts); past it the call is aborted with "
                                 "RESOURCE_EXHAUSTED (HTTP: an error event)")
    max_header_bytes: int = opt(64 * 1024, "largest HTTP request head (request line and headers), counted as "
                                "it arrives: 431 and the connection closed beyond")
    http_read_timeout_s: float = opt(30.0, "seconds an HTTP client may take to send a request's headers "
                                     "(connection closed past it), and then its body (408)")
    tls_cert: str | None = opt(None, "PEM certificate chain for TLS")
    tls_key: str | None = opt(None, "PEM private key for TLS")
    tls_client_ca: str | None = opt(None, "PEM CA certificate(s): require a client certificate signed "
                                    "by one of them (mutual TLS; needs --tls-cert)")
    api_key: str | None = opt(None, "require this key in the 'authorization: Bearer <key>' metadata "
                              f"(visible in `ps`: prefer --api-key-file or env {API_KEY_ENV})")
    api_key_file: str | None = opt(None, "read the API key from this file (its first line)")
    enable_reflection: bool = opt(True, "offer gRPC server reflection (grpcurl list/describe)")
    shutdown_grace_s: float = opt(30.0, "seconds in-flight requests may finish after SIGTERM")

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _require(0 <= self.http_port <= 65535, "http_port", f"must be in [0, 65535], got {self.http_port}")
        _require(self.enable_grpc or self.enable_http, "enable_http", "--no-enable-grpc and --no-enable-http "
                 "leave nothing to serve")
        _require(self.max_queue_size >= 1, "max_queue_size", "must be >= 1")
        _require(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")
        _require(self.max_prompt_bytes >= 1, "max_prompt_bytes", "must be >= 1")
        _require(self.max_stream_buffer >= 1, "max_stream_buffer", "must be >= 1")
        _require(self.max_header_bytes >= 1024, "max_header_bytes", "must be >= 1024")
        _require(self.http_read_timeout_s > 0, "http_read_timeout_s", "must be > 0")
        _require(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        _require(self.tool_call_parser in (None, "hermes"), "tool_call_parser",
                 f"must be hermes, got {self.tool_call_parser!r}")
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "enable_auto_tool_choice",
                 "needs --tool-call-parser")
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert",
                 "--tls-cert and --tls-key must be given together")
        _require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca",
                 "mutual TLS needs the server's own --tls-cert and --tls-key")
        _require(self.api_key is None or self.api_key_file is None, "api_key_file",
                 "give --api-key or --api-key-file, not both")
        _require(self.api_key is None or self.api_key != "", "api_key", "must not be empty")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "api_key_file"):
            path = getattr(self, name)
            _require(path is None or os.path.isfile(path), name, f"no such file: {path!r}")

    def resolve_api_key(self) -> str | None:
        """The key to require: --api-key, else the first line of --api-key-file, else env JAXCPP_API_KEY."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_file is not None:
            with open(self.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
            _require(bool(key), "api_key_file", f"{self.api_key_file} is empty")
            return key
        return os.environ.get(API_KEY_ENV) or None


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
        _require(kv is None or not self.cache.calculate_kv_scales, "calculate_kv_scales",
                 "cannot be used with --kv-transfer-config: producer and consumer must share the checkpoint's scales")
        if kv is not None and kv.consumes and self.kv_transfer.prefill_servers is not None:
            _require(self.parallel.executor_backend == "inproc", "kv_transfer_config",
                     "a kv_consumer pulls KV pages into the stages of its own process: "
                     "--distributed-executor-backend inproc (the default on one host)")
        if self.chunking.enable_dynamic_chunking and not self.dynamic_chunking:
            log.warning("--enable-dynamic-chunking is off on a kv_consumer: it decodes, the producers prefill "
                        "(turn it on there)")
        elif self.chunking.enable_dynamic_chunking:
            _require(self.parallel.pipeline_parallel_size > 1, "enable_dynamic_chunking",
                     "needs --pipeline-parallel-size > 1")
            _require(self.scheduler.enable_chunked_prefill, "enable_dynamic_chunking",
                     "needs chunked prefill (drop --no-enable-chunked-prefill)")

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
    warnings.warn(f"{_flag(name)} is deprecated: use {_flag(new)}", FutureWarning, stacklevel=3)
    return new


ENGINE_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "parallel": ParallelConfig, "chunking": ChunkingConfig, "kv_transfer": KVTransferConfig,
}
