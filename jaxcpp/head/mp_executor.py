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
(`jaxcpp.pipe.cluster`: the head hands its own to the stage it spawns). A spawned stage's stderr
passes through the head, which keeps its last lines to say why it ended.

One reader thread per stage receives what the stage sends (timings, the last stage's results,
replies); a closed connection means the stage process ended, and every waiting or later call raises
`ExecutorError(stage=s)` naming how it ended (for a spawned stage, its exit code or signal): within
milliseconds of the death, well inside the 2 s the contract asks. The stages run their micro-batches
in submission order and each blocks on its own output, so up to P micro-batches are in flight (P + 1
outstanding with async scheduling, whose fed-back tokens the first stage pulls from the last).

The head by job: this module is the executor proper (submit / collect, the readers, timings, failures,
KV offers); `jaxcpp.head.supervision` spawns, watches and stops the stage processes and picks ports;
`jaxcpp.head.startup` runs the start-up handshake and sizing. The wire format, the cluster's addresses
and the trace are shared with the stage side, owned by neither (`jaxcpp.pipe`).
"""

from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time
from multiprocessing.connection import Listener
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
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.core.step_input import StepShape, pack, padding_step
from jaxcpp.head.startup import StageHandshake
from jaxcpp.head.supervision import StageLink, accept_stages, free_port, how_it_ended, spawn_stage, stop_stage
from jaxcpp.models.spec import ModelSpec
from jaxcpp.pipe import wire
from jaxcpp.pipe.cluster import Addresses, shared_control_key, split_host_port
from jaxcpp.pipe.trace import TraceWriter

log = logging.getLogger(__name__)

MAX_KEPT = 100_000                   # timing records kept for timings() / probes()
STOP_GRACE_S = 5.0                   # a stage told to stop gets this long before it is killed
FAILED_STOP_GRACE_S = 0.5            # ... after a failure, when it may be blocked on a dead peer
WARMUP_STEP_ID = -1                  # its own step (the scheduler's are >= 0)
PEER_DEATH_WAIT_S = 0.5              # a stage's error waits this long for a dead peer's to come first


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
        self.links = [StageLink(s) for s in range(self.num_stages)]
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
        threading.Thread(target=accept_stages, args=(self._listener, accepted), name="jaxcpp-stage-accept",
                         daemon=True).start()
        for s in spawn:
            spawn_stage(self.links[s], control_port, authkey, advertise)
        try:
            self.sizing = StageHandshake(self._config, self._spec, self.links, coordinator).run(accepted)
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

    def _reply(self, ln: StageLink, what: str) -> dict[str, Any]:
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
    def _read(self, ln: StageLink) -> None:
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

    def _on_timing(self, ln: StageLink, h: dict[str, Any]) -> None:
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
                  "num_seqs": int(step.num_seqs), "bitmask": request.bitmask is not None}
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

    @property
    def mla_rebuild_weight(self) -> float | None:
        """The first stage's (each stage measured its own under --mla-prefill auto; see core/executor.py)."""
        return self.links[0].mla_rebuild_weight

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
            stop_stage(ln, grace)
        self._listener.close()
        if self._trace is not None:
            self._trace.close()
        with self._lock:
            self._lock.notify_all()

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
