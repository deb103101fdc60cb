"""The multi-process executor, head side: one OS process per pipeline stage, on one host or many.

    executor = MultiProcessExecutor(config, spec)     # spawns (or waits for) P stage processes, sizes
    executor.sizing                                   # the engine on their backend, sends them that sizing
    executor.submit(StepRequest(step_id, step))  # the step packed once, the same few KB to every stage
    result = executor.collect(step_id)  # tokens / logits / timings from the last stage

Topology (docs/pipeline.md):

    head (engine, gRPC; no jax backend)        control channel: one authenticated TCP connection
      |-- stage 0 process  (T devices)  --+    per stage, JSON headers + raw arrays (`wire`)
      |-- stage 1 process  (T devices)  <-+ activations: jax.experimental.transfer, stage to stage
      ...                                      jax.distributed: stage 0 hosts the coordinator; the
      '-- stage P-1 process -> tokens to head  stages find each other's transfer servers through it

On one host (`--distributed-executor-backend mp`) the head spawns the P stage processes itself, all on
127.0.0.1. With `--num-processes P --process-id I` every host runs `jaxcpp serve`: process 0 is the head
and spawns stage 0 beside itself, host I runs stage I (`jaxcpp.runtime.stage_process.serve_stage`); the
control channel listens on the coordinator's port + 1, and each stage advertises its host's address
(`jaxcpp.head.cluster`: the head hands its own to the stage it spawns). A spawned stage's stderr
passes through the head, which keeps its last lines to say why it ended.

One reader thread per stage receives what the stage sends (timings, the last stage's results,
replies); a closed connection means the stage process ended, and every waiting or later call raises
`ExecutorError(stage=s)` naming how it ended (for a spawned stage, its exit code or signal): within
milliseconds of the death, well inside the 2 s the contract asks. The stages run their micro-batches
in submission order and each blocks on its own output, so up to P micro-batches are in flight (P + 1
outstanding with async scheduling, whose fed-back tokens the first stage pulls from the last).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from multiprocessing.connection import wait as connection_wait
from typing import Any

from jaxcpp.config import EngineConfig
from jaxcpp.core.buckets import bucket_progress
from jaxcpp.core.executor import (
    ExecutorError,
    FailureListener,
    HostPhase,
    Logprobs,
    StageTiming,
    StepRequest,
    StepResult,
)
from jaxcpp.core.kv_transfer import KVOffer, KVSource
from jaxcpp.core.sizing import EngineSizing, dtype_on_backend
from jaxcpp.core.step_input import StepShape, pack, padding_step
from jaxcpp.head import wire
from jaxcpp.head.cluster import CONTROL_KEY_ENV, Addresses, shared_control_key, split_host_port
from jaxcpp.head.trace import TraceWriter
from jaxcpp.models.spec import ModelSpec

log = logging.getLogger(__name__)

START_TIMEOUT_S = float(os.environ.get("JAXCPP_STAGE_START_TIMEOUT_S", "600"))
PIN_ENV = "JAXCPP_PIN_STAGE_CORES"   # "1": each stage on its own cores, single-threaded XLA:CPU
MAX_KEPT = 100_000                   # timing records kept for timings() / probes()
STOP_GRACE_S = 5.0                   # a stage told to stop gets this long before it is killed
FAILED_STOP_GRACE_S = 0.5            # ... after a failure, when it may be blocked on a dead peer
WARMUP_STEP_ID = -1                  # its own step (the scheduler's are >= 0)
PEER_DEATH_WAIT_S = 0.5              # a stage's error waits this long for a dead peer's to come first


@dataclasses.dataclass
class _StageLink:
    index: int
    conn: Any = None
    pid: int | None = None
    host: str = ""
    address: str = ""                      # the address it advertises (its transfer server binds it)
    transfer: str = ""                     # its transfer server, once ready
    layers: tuple[int, int] = (0, 0)       # its layers [start, end), once ready
    compilations: int = 0                  # the stage's own count, as of its latest message
    sized: tuple[str, int] | None = None   # the (dtype, KV pages) it built, as it reported them
    clock_offset: float = 0.0              # add to the stage's perf_counter to get the head's
    process: subprocess.Popen[bytes] | None = None   # when the head spawned it
    log_tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))
    reader: threading.Thread | None = None
    log_reader: threading.Thread | None = None
    replies: queue.SimpleQueue[dict[str, Any]] = dataclasses.field(default_factory=queue.SimpleQueue)
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def where(self) -> str:
        """pid, host and addresses, for error messages: what an operator needs to find the stage."""
        if self.pid is None:
            return f"pid {self.process.pid}, not connected" if self.process is not None else ""
        transfer = f", transfer server {self.transfer}" if self.transfer else ""
        return f"pid {self.pid} on {self.host} at {self.address}{transfer}"

    def error(self, message: str) -> ExecutorError:
        return ExecutorError(message, stage=self.index, where=self.where())


# Where free_port draws from: above the well-known services' ports, below the kernel's ephemeral range.
_FREE_PORTS_FROM = 10000
_DEFAULT_EPHEMERAL = (32768, 60999)


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel takes outgoing connections' source ports from (Linux's default elsewhere)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that another process binds seconds later.

    Drawn below the ephemeral range: a port the kernel hands out for a bind to 0 lies in that range, where
    outgoing connections take their source ports, and once on a busy machine such a port was taken
    before stage 0 bound it (its jax.distributed coordinator then failed: "Failed to start RPC server")."""
    low = ephemeral_ports()[0]
    below = range(_FREE_PORTS_FROM, low)
    for port in random.sample(below, 64) if len(below) >= 1024 else ():
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range, or none of 64 free: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def how_it_ended(ln: _StageLink, wait_s: float = 1.0) -> str:
    process = ln.process
    if process is None:
        return "its control connection closed (process gone, or its host unreachable: see that host's log)"
    try:
        code = process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return f"process {process.pid} closed its control connection"
    if ln.log_reader is not None:
        ln.log_reader.join(timeout=0.5)  # its last lines, still in the pipe
    if code < 0 and -code in (signal.SIGKILL, signal.SIGTERM):  # killed from outside: its log says nothing
        return f"process {process.pid} was killed by {signal.Signals(-code).name}"
    ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    last = last_words(ln.log_tail) if code != 0 else ""
    return f"process {process.pid} {ended}" + (f"; its log ends: {last}" if last else "")


def last_words(lines: collections.deque[str]) -> str:
    """Why a process died, from its last log lines: jax's fatal line (a failed CHECK in native code),
    else its last line (a Python exception's)."""
    fatal = [line for line in lines if re.match(r"F\d{4} ", line)]
    last = fatal[-1] if fatal else (lines[-1] if lines else "")
    return last if len(last) <= 400 else last[:400] + " ..."


def forward_log(ln: _StageLink, stream: Any) -> None:
    """A spawned stage's stderr, passed on to the head's; the lines that are not stack frames are kept."""
    for raw in stream:
        line = raw.decode(errors="replace")
        sys.stderr.write(line)
        if line.strip() and not line.startswith((" ", "\t", "***")):
            ln.log_tail.append(line.rstrip())
    sys.stderr.flush()


class MultiProcessExecutor:
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        """`spec`: the model folder's, with the dtype asked for; `--dtype auto` is resolved on the stages'
        backend, which only they hold (`sizing`, set once they said which)."""
        p = config.parallel
        self.num_stages = p.pipeline_parallel_size
        self.max_in_flight = self.num_stages
        self._config = config
        self._spec = spec
        self.sizing: EngineSizing  # set by the start-up, before any stage builds its layers
        self._lock = threading.Condition()
        self._failure: ExecutorError | None = None
        self._failure_listeners: list[FailureListener] = []
        self._closed = False
        self._submitted: dict[int, StepRequest] = {}  # by step id, until collected
        self._results: dict[int, tuple[dict[str, Any], list[Any]]] = {}
        # Async scheduling across processes: the last stage offers each sampled step's tokens to the
        # first as soon as it has them; the first pulls the one a step feeds back from, and drains
        # the offers no step will read (steps collected without being fed back from).
        self._offers_tokens = self.num_stages > 1 and config.scheduler.async_scheduling
        self._offered: set[int] = set()
        self._to_drain: list[int] = []
        self._partial: dict[int, dict[int, StageTiming]] = {}
        self._acked: dict[int, tuple[StageTiming, ...]] = {}
        self._history: collections.deque[StageTiming] = collections.deque(maxlen=MAX_KEPT)
        self._probes: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_KEPT)
        self._submit_times: dict[int, float] = {}
        self._traced = False
        self._shape: StepShape | None = None
        self._trace: TraceWriter | None = None
        self.links = [_StageLink(s) for s in range(self.num_stages)]
        if p.stand_in_latency is not None:
            log.warning("STAND-IN DEVICE (--stand-in-latency %s, jitter %g): the stage processes run no model, "
                        "each forward is a timed wait and the tokens are not a model's; for benchmarks and "
                        "load tests only", p.stand_in_latency, p.stand_in_jitter)
        self._start(p.is_multi_host, p.coordinator_address)

    # ---- start-up ------------------------------------------------------------------------------
    def _start(self, multi_host: bool, coordinator: str | None) -> None:
        if multi_host:  # the head's own host runs stage 0 (and so the coordinator)
            addresses = Addresses.of(self._config.parallel)
            authkey, coordinator, advertise = shared_control_key(), addresses.coordinator, addresses.advertise
            control_port = split_host_port(addresses.control)[1]
            listen, spawn = ("0.0.0.0", control_port), [0]
        else:
            kv = self._config.kv_transfer.settings()
            # a producer's stages offer KV pages to other hosts: their transfer servers bind its kv_ip
            control_port, advertise = free_port(), kv.ip if kv is not None and kv.produces else "127.0.0.1"
            listen, authkey = ("127.0.0.1", control_port), secrets.token_bytes(16)
            coordinator = f"127.0.0.1:{free_port()}"
            spawn = list(range(self.num_stages))
        self._coordinator = coordinator
        self._listener = Listener(listen, authkey=authkey)
        accepted: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._accept, args=(accepted,), name="jaxcpp-stage-accept", daemon=True).start()
        for s in spawn:
            self._spawn(self.links[s], control_port, authkey, advertise)
        try:
            self._handshake(accepted)
        except BaseException:
            self.close()
            raise
        names = [f"stage {ln.index}: pid {ln.pid} on {ln.host}" for ln in self.links]
        if self._config.parallel.trace_file:
            self._trace = TraceWriter(self._config.parallel.trace_file, time.perf_counter(), names)
        for ln in self.links:
            ln.reader = threading.Thread(target=self._read, args=(ln,), name=f"jaxcpp-stage{ln.index}-reader",
                                         daemon=True)
            ln.reader.start()

    def _spawn(self, ln: _StageLink, control_port: int, authkey: bytes, advertise: str) -> None:
        env = {**os.environ, CONTROL_KEY_ENV: authkey.hex()}
        env.pop("XLA_FLAGS", None)  # the stage sets its own device count (the head's is not its)
        cmd = [sys.executable, "-m", "jaxcpp.runtime.stage_process", "--control", f"127.0.0.1:{control_port}",
               "--stage", str(ln.index), "--advertise-address", advertise, "--parent-pid", str(os.getpid())]
        ln.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ln.log_reader = threading.Thread(target=forward_log, args=(ln, ln.process.stderr),
                                         name=f"jaxcpp-stage{ln.index}-log", daemon=True)
        ln.log_reader.start()

    def _accept(self, accepted: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                accepted.put(self._listener.accept())
            except OSError:   # closed
                return
            except Exception as e:  # noqa: BLE001 - a bad handshake (wrong key) must not stop accepting
                log.warning("refused a control connection: %s", e)

    def _handshake(self, accepted: queue.SimpleQueue[Any]) -> None:
        """Every stage says hello and gets the config; then each loads and places its layers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(self.num_stages))
        while waiting:
            self._check_spawned(deadline, waiting)
            try:
                conn = accepted.get(timeout=0.2)
            except queue.Empty:
                continue
            wire.no_delay(conn)
            hello, _ = wire.recv(conn)
            s = hello.get("stage")
            if s not in waiting:
                wire.send(conn, {"op": "refused", "reason": f"stage {s} is not awaited (have "
                                 f"{self.num_stages} stages; waiting for {sorted(waiting)})"})
                conn.close()
                continue
            waiting.discard(s)
            ln = self.links[s]
            ln.conn, ln.pid, ln.host, ln.address = conn, hello["pid"], hello["host"], hello["address"]
            if ln.host != socket.gethostname():
                ln.clock_offset = time.perf_counter() - hello["clock"]  # one-way latency ignored
            wire.send(conn, self._setup_for(s))
        self._size_stages(deadline)
        self._await_ready(deadline)

    def _size_stages(self, deadline: float) -> None:
        """Every stage says which backend it holds; the head resolves `--dtype auto` on it, sizes the engine
        once and sends that sizing to every stage, which builds its layers and KV pages from it."""
        backends = {ln.index: header["backend"] for ln, header in self._await_all("backend", deadline)}
        if len(set(backends.values())) > 1:
            raise ExecutorError(f"the stages hold different backends (stage: backend): {backends}")
        dtype = dtype_on_backend(self._config.model.dtype, backends[0])
        if dtype != self._config.model.dtype:
            log.info("--dtype auto on the stages' %s backend: %s", backends[0], dtype)
        self.sizing = EngineSizing.plan(self._config, self._spec.with_dtype(dtype))
        for ln in self.links:
            wire.send(ln.conn, {"op": "sizing", "sizing": self.sizing.to_message()})

    def _await_ready(self, deadline: float) -> None:
        """Each stage loads in parallel and says what it built; it must be what the head sized."""
        sized = (self.sizing.spec.config.dtype, self.sizing.num_pages)
        for ln, header in self._await_all("ready", deadline):
            ln.transfer = header["transfer"]
            ln.layers = (header["layers"][0], header["layers"][1])
            ln.sized = (header["dtype"], header["num_pages"])
            if ln.sized != sized:
                raise ln.error(f"built (dtype, KV pages) {ln.sized}, the head sized {sized}")
            log.info("stage %d of %d ready: %s, layers %d-%d, devices %s", ln.index, self.num_stages,
                     ln.where(), header["layers"][0], header["layers"][1] - 1, ",".join(header["devices"]))

    def _await_all(self, op: str, deadline: float) -> list[tuple[_StageLink, dict[str, Any]]]:
        """Every stage's start-up message `op`, in stage order. The first stage that fails (an error, or its
        process ended) stops the start-up at once: the others may wait on it inside jax.distributed."""
        waiting, got = {ln.index: ln for ln in self.links}, []
        while waiting:
            if time.monotonic() > deadline:
                raise ExecutorError(f"stages {sorted(waiting)} not ready within {START_TIMEOUT_S:.0f}s")
            connection_wait([ln.conn for ln in waiting.values()], timeout=0.2)
            for ln in list(waiting.values()):
                header = self._start_message(ln, op)
                if header is not None:
                    del waiting[ln.index]
                    got.append((ln, header))
        return sorted(got, key=lambda item: item[0].index)

    def _start_message(self, ln: _StageLink, op: str) -> dict[str, Any] | None:
        """Stage `ln`'s message `op` if it is there; ExecutorError if the stage failed or ended."""
        if not ln.conn.poll(0):
            if ln.process is not None and ln.process.poll() is not None:
                raise ln.error(f"failed during start-up: {how_it_ended(ln)}")
            return None
        try:
            header, _ = wire.recv(ln.conn)
        except (EOFError, OSError):
            raise ln.error(f"failed during start-up: {how_it_ended(ln)}") from None
        if header["op"] == "error":
            raise ln.error(header["message"])
        return header if header["op"] == op else None

    def _setup_for(self, stage: int) -> dict[str, Any]:
        tp = self._config.parallel.tensor_parallel_size
        cores = None
        if os.environ.get(PIN_ENV) == "1":
            n = os.cpu_count() or 1
            cores = sorted({(stage * tp + i) % n for i in range(tp)})
        return {"op": "setup", "config": json.loads(json.dumps(dataclasses.asdict(self._config))),
                "coordinator": self._coordinator, "num_stages": self.num_stages,
                "tensor_parallel_size": tp, "cores": cores}

    def _check_spawned(self, deadline: float, waiting: set[int]) -> None:
        for ln in self.links:
            if ln.process is not None and ln.process.poll() is not None:
                raise ln.error(f"did not start: {how_it_ended(ln)}")
        if time.monotonic() > deadline:
            raise ExecutorError(f"stages {sorted(waiting)} did not connect within {START_TIMEOUT_S:.0f}s "
                                f"(coordinator {self._coordinator})")

    def _reply(self, ln: _StageLink, what: str) -> dict[str, Any]:
        """The next reply of stage `ln`, from its reader thread."""
        while True:
            self._raise_if_failed()
            try:
                header = ln.replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if header["what"] == what:
                return header

    # ---- the reader threads --------------------------------------------------------------------
    def _read(self, ln: _StageLink) -> None:
        while True:
            try:
                header, arrays = wire.recv(ln.conn)
            except (EOFError, OSError):
                if not self._closed:
                    self._fail(ln.error(f"stage process ended: {how_it_ended(ln)}"))
                return
            op = header["op"]
            ln.compilations = header.get("compilations", ln.compilations)
            if op == "timing":
                self._on_timing(ln, header)
            elif op == "result":
                with self._lock:
                    self._results[header["id"]] = (header, arrays)
                    self._lock.notify_all()
            elif op == "compiled":
                log.info("stage %d %s", header["stage"], bucket_progress(
                    header["bucket"], header["of"], header["num_tokens"], header["seconds"],
                    header.get("programs", 0), header.get("from_cache", 0)))
            elif op == "error":
                self._fail_after_dead_peers(ln.error(f"micro-batch {header['id']} failed: {header['message']}"))
            else:
                ln.replies.put(header)

    def _on_timing(self, ln: _StageLink, h: dict[str, Any]) -> None:
        off = ln.clock_offset
        step_id = h["id"]
        with self._lock:
            submitted = self._submit_times.get(step_id, float("nan"))
            timing = StageTiming(step_id, ln.index, h["num_tokens"], self._traced, submitted, h["inputs_ready"] + off,
                                 h["start"] + off, h["done"] + off)
            local = ("idle_since", "received", "pull_start", "inputs_ready", "start", "done")
            self._probes.append({**h, **{k: h[k] + off for k in local}, "submitted": submitted})
            parts = self._partial.setdefault(step_id, {})
            parts[ln.index] = timing
            if len(parts) < self.num_stages:
                return
            del self._partial[step_id]
            self._submit_times.pop(step_id, None)
            ordered = tuple(parts[s] for s in range(self.num_stages))
            self._history.extend(ordered)
            self._acked[step_id] = ordered
            self._lock.notify_all()
        if self._trace is not None and timing.traced:
            for t in ordered:
                self._trace.add(t)

    def _fail_after_dead_peers(self, error: ExecutorError) -> None:
        """A stage's error that follows another stage's death (its transfer from the dead peer failed)
        is the dead stage's failure: that stage's reader gets a moment to report it first."""
        with self._lock:
            self._lock.wait_for(lambda: self._failure is not None, timeout=PEER_DEATH_WAIT_S)
        self._fail(error)

    def _fail(self, error: ExecutorError) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = error
                log.error("pipeline failed: %s", error)
            self._lock.notify_all()
        if first:
            for listener in list(self._failure_listeners):
                listener(error)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ExecutorError("the executor is closed")

    # ---- the Executor contract -----------------------------------------------------------------
    def warmup(self, shape: StepShape) -> float:
        """Every stage compiles every bucket on its own (in threads), in parallel; then one micro-batch of the
        smallest bucket goes through the whole pipe (the transfers between processes)."""
        self._shape = shape
        start = time.perf_counter()
        self._broadcast({"op": "warmup"})
        for ln in self.links:
            self._reply(ln, "warmup")
        self.submit(StepRequest(WARMUP_STEP_ID, padding_step(shape.token_buckets[0], shape), want_logits=True,
                                ack=True))
        self.collect(WARMUP_STEP_ID)
        self._traced = True
        log.info("warm-up on %d stage processes: %.1fs", self.num_stages, time.perf_counter() - start)
        return time.perf_counter() - start

    def submit(self, request: StepRequest) -> None:
        self._raise_if_failed()
        step, step_id = request.step, request.step_id
        buf, layout = pack(step)
        offer = self._offers_tokens and request.want_tokens
        self._offered.discard(request.feedback_from)
        header = {"op": "step", "id": step_id, "num_tokens": step.num_tokens_padded,
                  "layout": [[f.name, list(f.shape), f.dtype.str] for f in layout], **request.flags(),
                  "offer_tokens": offer, "drain_tokens": self._to_drain, "needs_full_sampler": step.needs_full_sampler,
                  "bitmask": request.bitmask is not None}
        self._to_drain = []
        if offer:
            self._offered.add(step_id)
        with self._lock:
            self._submit_times[step_id] = time.perf_counter()
        bitmask = request.bitmask
        self._broadcast(header, [buf], last=None if bitmask is None else [buf, bitmask])  # the sampler's mask
        self._submitted[step_id] = request

    def collect(self, step_id: int) -> StepResult:
        """Once every stage has timed the step (it left the pipe, holding no activation any more), with
        the last stage's tokens / logits / logprobs when the step asked for them."""
        head = self._submitted.pop(step_id)
        if step_id in self._offered:  # no step submitted from now on can feed back from it
            self._offered.remove(step_id)
            self._to_drain.append(step_id)
        with self._lock:
            while not ((not head.wants_result or step_id in self._results) and step_id in self._acked):
                self._raise_if_failed()
                self._lock.wait(0.5)
            header, arrays = self._results.pop(step_id, ({}, []))
            timings = self._acked.pop(step_id)
        it = iter(arrays)
        tokens = next(it) if header.get("tokens") else None
        logits = next(it) if header.get("logits") else None
        logprobs = Logprobs(next(it), next(it), next(it)) if header.get("logprobs") else None
        prompt = Logprobs(next(it), next(it), next(it)) if header.get("prompt_logprobs") else None
        return StepResult(tokens, logits, timings if head.ack else (), logprobs, prompt)

    def time_attention_free_forward(self, num_tokens: int) -> float:
        """The slowest stage's attention-free forward of `num_tokens`, each stage timing its own, all
        at once (its program is compiled and run once untimed on first use)."""
        if self._shape is None:
            raise RuntimeError("time_attention_free_forward() needs warmup() first (it fixes the shapes)")
        self._broadcast({"op": "attention_free", "num_tokens": num_tokens})
        return max(float(self._reply(ln, "attention_free")["seconds"]) for ln in self.links)

    def record_host_phases(self, phases: list[HostPhase]) -> None:
        if self._trace is not None and self._traced:
            for phase in phases:
                self._trace.add_host(phase)

    def num_compilations(self) -> int:
        """Programs compiled in every stage process since it started: each stage counts its own and
        reports it with every message (so this never waits; it is current as of the last collect)."""
        return sum(ln.compilations for ln in self.links)

    def add_failure_listener(self, callback: FailureListener) -> None:
        """`callback(error)` once, from a reader thread, when a stage fails: the server turns
        NOT_SERVING even while the engine idles (no step would otherwise see the failure)."""
        self._failure_listeners.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def close(self) -> None:
        """Stop every stage process, the last first: stage 0's process hosts jax's coordination service,
        and a stage that sees it go before its own stop arrives aborts instead of exiting 0. Spawned
        stages are killed when they do not exit in 5 s (0.5 s after a failure: they may be blocked on a
        dead peer). Idempotent."""
        if self._closed:
            return
        self._closed = True
        grace = FAILED_STOP_GRACE_S if self._failure is not None else STOP_GRACE_S
        for ln in reversed(self.links):
            self._stop(ln, grace)
        self._listener.close()
        if self._trace is not None:
            self._trace.close()
        with self._lock:
            self._lock.notify_all()

    def _stop(self, ln: _StageLink, grace: float) -> None:
        if ln.conn is not None:
            try:
                with ln.send_lock:
                    wire.send(ln.conn, {"op": "stop"})
            except OSError:
                pass
        if ln.process is not None:
            try:
                ln.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                ln.process.kill()
                ln.process.wait(timeout=5)
        elif ln.reader is not None:  # another host's: its connection closes when it exits
            ln.reader.join(timeout=grace)

    # ---- beyond the contract: probes for tests and benchmarks ------------------------------------
    @property
    def failure(self) -> ExecutorError | None:
        return self._failure

    def stage_pids(self) -> list[int | None]:
        return [ln.pid for ln in self.links]

    def timings(self) -> list[StageTiming]:
        with self._lock:
            return list(self._history)

    def probes(self) -> list[dict[str, Any]]:
        """Raw per-stage records on the head's clock: submitted (by the head), idle_since (the stage began
        waiting for this message), received, pull_start, inputs_ready, done."""
        with self._lock:
            return list(self._probes)

    def offer_kv(self, transfer_id: int, pages: list[int]) -> KVOffer:
        """Every stage gathers its layers' `pages` and offers them on its own transfer server, in order with
        the steps on its control channel (so later steps may reuse the pages); nothing waits here."""
        self._raise_if_failed()
        self._broadcast({"op": "offer_kv", "id": transfer_id, "pages": pages})
        return KVOffer(tuple(KVSource(ln.transfer, *ln.layers) for ln in self.links), len(pages))

    def _broadcast(self, header: dict[str, Any], arrays: list[Any] = (),  # type: ignore[assignment]
                   last: list[Any] | None = None) -> None:
        """`header` and `arrays` to every stage; `last`: the last stage's arrays instead."""
        for ln in self.links:
            try:
                with ln.send_lock:
                    wire.send(ln.conn, header, last if last is not None and ln is self.links[-1] else arrays)
            except OSError as e:
                self._fail(ln.error(f"sending to the stage process failed: {e}; {how_it_ended(ln)}"))
                self._raise_if_failed()
