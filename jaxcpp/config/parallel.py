"""Where the model runs: pipeline stages, devices per stage, one host or several (`ParallelConfig`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.config.fields import ConfigError, opt, require


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
    # The command line fills these three from the environment when their flags are not given
    # (jaxcpp.cli_args); built in Python, a pipeline over several hosts names them.
    coordinator_address: str | None = opt(
        None, "host:port of the jax.distributed coordinator (stage 0's process, on the head's host) for a "
        "pipeline over several hosts; the head's control channel listens on port + 1 (default: env "
        "JAX_COORDINATOR_ADDRESS, else LWS_LEADER_ADDRESS:8476)")
    num_processes: int | None = opt(None, "processes (hosts) in the pipeline, one per stage (default: env "
                                    "JAX_NUM_PROCESSES, else LWS_GROUP_SIZE)")
    process_id: int | None = opt(None, "this process's index: 0 is the head (engine, gRPC and stage 0), I > 0 "
                                 "runs stage I (default: env JAX_PROCESS_ID, else LWS_WORKER_INDEX)")
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
        require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        self._check_distributed()
        self._check_stand_in()
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        require(self.distributed_heartbeat_timeout_s >= 1, "distributed_heartbeat_timeout_s",
                f"must be >= 1, got {self.distributed_heartbeat_timeout_s}")
        if self.pp_partition is not None:
            parts = self.partition_list()
            require(len(parts) == self.pipeline_parallel_size, "pp_partition",
                    f"gives {len(parts)} stages but --pipeline-parallel-size is {self.pipeline_parallel_size}")
            require(all(p >= 1 for p in parts), "pp_partition", "every stage needs at least one layer")

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
        require(n is None or n >= 1, "num_processes", f"must be >= 1, got {n}")
        if not self.is_multi_host:
            require(pid in (None, 0), "process_id", f"is {pid} but --num-processes is {n or 1}")
            require(self.advertise_address is None, "advertise_address",
                    "applies to a pipeline over several hosts (--num-processes > 1); on one host every "
                    "stage uses 127.0.0.1")
            return
        assert n is not None  # is_multi_host
        require(self.distributed_executor_backend != "inproc", "distributed_executor_backend",
                f"inproc runs every stage in one process; --num-processes {n} needs mp")
        require(n == self.pipeline_parallel_size, "num_processes",
                f"({n}) must equal --pipeline-parallel-size ({self.pipeline_parallel_size}): one process per stage")
        require(pid is not None and 0 <= pid < n, "process_id", f"must be in [0, {n}), got {pid}")
        require(self.coordinator_address is not None and ":" in self.coordinator_address,
                "coordinator_address", f"host:port is needed with --num-processes {n}, got "
                f"{self.coordinator_address!r}")
        if self.advertise_address is not None:
            try:
                ipaddress.ip_address(self.advertise_address)
            except ValueError:
                raise ConfigError(f"--advertise-address: an IP address of this host is needed (the transfer "
                                  f"server binds it), got {self.advertise_address!r}") from None

    def _check_stand_in(self) -> None:
        require(self.stand_in_jitter >= 0, "stand_in_jitter", f"must be >= 0, got {self.stand_in_jitter}")
        if self.stand_in_latency is None:
            return
        require(self.executor_backend == "mp", "stand_in_latency",
                "runs in stage processes: add --distributed-executor-backend mp")
        try:
            model = LatencyModel.parse_coeffs(self.stand_in_latency)
        except ValueError:
            model = None
        require(model is not None and min(model.a, model.b, model.c, model.gamma) >= 0, "stand_in_latency",
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
