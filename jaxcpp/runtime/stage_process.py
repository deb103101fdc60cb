"""One pipeline stage in its own OS process: the stage side of the multi-process executor.

    python -m jaxcpp.runtime.stage_process --control HOST:PORT --stage S --advertise-address IP [--parent-pid PID]
    (or `jaxcpp serve --num-processes N --process-id S ...` on host S > 0, which calls serve_stage)

How a stage process comes up and runs:

    1. connect to the head's control channel (TCP, HMAC-authenticated; retried until the head is up),
       say hello (stage index, pid, host, the address it advertises), receive the head's EngineConfig
       and the coordinator address
    2. set its own device count (XLA_FLAGS, T devices for TP inside the stage) and, when it is to be
       pinned, single-threaded XLA:CPU; only then import jax (and, pinned, run forwards inline:
       `run_forwards_inline_on_cores`)
    3. jax.distributed.initialize(coordinator, P, S): stage 0's process hosts the coordination service
       (a later stage first checks that it can reach it); tell the head its backend and receive the
       head's sizing (`EngineSizing`: `--dtype auto` resolved, pages, buckets; a stage never sizes
       itself); build its `Stage` from its own layers (`load_stage_params`); start its transfer
       server on the advertised address and publish it in the service's key-value store, check that
       it can connect to its neighbours' (`cluster`), and connect to the previous stage's (discovery
       through jax.distributed, not a home-made protocol)
    4. tell the head it is ready (with its transfer server's address, and the dtype and KV pages it
       built); until then a message other than the sizing, or a closed channel, from the head means
       the head gave up: the stage exits instead of waiting for peers
    5. loop over control messages (`jaxcpp.head.wire`), in order:
         step      -> put the packed step on its devices, pull the activations of the same micro-batch
                      from stage S-1 (`jax.experimental.transfer`), run, time the model call, then
                      offer its output to stage S+1 (await_pull) or, on the last stage, send tokens
                      (and logits when asked) to the head; every stage sends its timing record
         warmup    -> compile every bucket on its own (zero activations), all stages in parallel
         attention_free / count / stop

Activations go stage to stage; the head only ever sees the few-KB step and the last stage's tokens.
The process exits when the head says stop, when the control channel closes (the head died), or when
its parent (a spawning head) is gone: no orphans. A spawned stage ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group): the head drains and stops it.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any

import numpy as np

from jaxcpp.head import wire
from jaxcpp.head.cluster import (
    check_local,
    check_reachable,
    host_port,
    is_loopback,
    shared_control_key,
    split_host_port,
)

log = logging.getLogger("jaxcpp.stage")

CONNECT_TIMEOUT_S = float(os.environ.get("JAXCPP_STAGE_CONNECT_TIMEOUT_S", "600"))
COORDINATOR_WAIT_S = 120.0   # a later stage may start well before stage 0's process hosts the coordinator


def connect(address: tuple[str, int], authkey: bytes, parent_pid: int | None) -> Any:
    """The head's control channel; retried while the head starts (multi-host hosts start in any order)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, OSError) as e:
            if time.monotonic() > deadline or (parent_pid is not None and os.getppid() != parent_pid):
                raise ConnectionError(f"no head at {address[0]}:{address[1]}: {e}") from e
            time.sleep(0.2)


def configure_process(num_devices: int, cores: list[int] | None) -> None:
    """Before jax is imported: this stage's T devices (on CPU) and, when it will be pinned to its own
    cores (`pin_to_cores`), single-threaded XLA:CPU, so that stages really run side by side."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={num_devices}"
    if cores and "xla_cpu_multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["XLA_FLAGS"] = flags.strip()


def pin_to_cores(cores: list[int], pid: int | str = "self") -> None:
    """Every thread of process `pid` (this one by default), and so every thread it starts later, on
    `cores` only."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def run_forwards_inline_on_cores(cores: list[int]) -> None:
    """A pinned stage: computations run on the calling thread, the client's pool serves the transfers.

    XLA:CPU sizes its client thread pool from the cores the process may use when the client is
    created, and with async dispatch that pool runs both the computations and the transfer server's
    sends. One thread (pinned first) and the send of micro-batch k waited behind the forward of k + 1;
    a thread per machine core (pinned after) and the send went through, but the forwards, split over
    threads time-sharing one core, took 30-40% longer than the same layers in one process. So: pinned
    before the client exists (a one-thread pool) and async dispatch off (the forward runs inline on
    this stage's own thread, which waits for it anyway): the pool's thread is free for sends, and the
    forward has the core to itself. Before jax's client exists, i.e. before any jax.devices().
    """
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    pin_to_cores(cores)
    jax.devices()


def watch_parent(parent_pid: int) -> None:
    """A spawned stage exits as soon as its head is gone, even while blocked on a transfer."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        os._exit(3)

    threading.Thread(target=run, name="jaxcpp-parent-watch", daemon=True).start()


def leave_ctrl_c_to_the_head(stage: int, spawned: bool) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole process group, the stages a head spawned included.
    Those leave it to the head, which drains and then stops every stage in order (stage 0, the
    coordinator's host, last); a stage started on its own host ends at once with one line. Either way no
    KeyboardInterrupt traceback from wherever the main thread was blocked (the control channel's recv)."""
    if spawned:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return

    def interrupted(signum: int, frame: Any) -> None:
        print(f"jaxcpp stage {stage}: interrupted (SIGINT); exiting", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted)


def watch_head_while_starting(conn: Any, stage: int) -> tuple[threading.Event, queue.SimpleQueue[dict[str, Any]]]:
    """Until this stage says ready the head sends nothing but its sizing (handed over through the returned
    queue) or `stop`, so anything else readable (or a closed channel) means the head gave up: exit rather
    than wait on a peer or a barrier that never comes. Set the returned event just before sending ready
    (or an error)."""
    ready = threading.Event()
    sizing: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def run() -> None:
        while not ready.is_set():
            try:
                if not conn.poll(0.25) or ready.is_set():
                    continue
                header = wire.recv(conn)[0]
            except (EOFError, OSError):
                header = {"op": "closed"}
            if header["op"] == "sizing":
                sizing.put(header["sizing"])
                continue
            stopped = header["op"] == "stop"
            log.error("stage %d: the head %s during start-up; exiting", stage,
                      "stopped the pipeline" if stopped else "closed the control channel")
            os._exit(0 if stopped else 1)

    threading.Thread(target=run, name="jaxcpp-start-watch", daemon=True).start()
    return ready, sizing


def serve_stage(control: str, stage: int, advertise: str, *, parent_pid: int | None = None) -> int:
    """Run stage `stage` until the head stops it; the exit code (0 when stopped by the head). `advertise`:
    this host's address, which the stage's transfer server binds and publishes (`cluster`)."""
    host, port = split_host_port(control)
    leave_ctrl_c_to_the_head(stage, spawned=parent_pid is not None)
    if parent_pid is not None:
        watch_parent(parent_pid)
    conn = connect((host, port), shared_control_key(), parent_pid)
    wire.no_delay(conn)
    wire.send(conn, {"op": "hello", "stage": stage, "pid": os.getpid(), "host": socket.gethostname(),
                     "address": advertise, "clock": time.perf_counter()})
    setup, _ = wire.recv(conn)
    if setup["op"] == "refused":
        print(f"jaxcpp stage {stage}: the head refused it: {setup['reason']}", file=sys.stderr)
        return 2
    configure_process(setup["tensor_parallel_size"], setup.get("cores"))
    ready, sizing = watch_head_while_starting(conn, stage)
    try:
        check_local(advertise)
        worker = StageWorker(conn, stage, setup, advertise, ready, sizing)
    except Exception as e:  # loading, placing or reaching a peer failed: the head names it and gives up
        ready.set()  # this process ends with its own exit code, not the watcher's
        message = str(e) if isinstance(e, ConnectionError) else repr(e)
        log.error("stage %d failed to start: %s", stage, message, exc_info=not isinstance(e, ConnectionError))
        wire.send(conn, {"op": "error", "id": -1, "message": f"start-up failed: {message}"})
        return 1
    return worker.loop()


class StageWorker:
    """Everything below runs after jax is configured for this process (configure_process)."""

    def __init__(self, conn: Any, index: int, setup: dict[str, Any], my_ip: str, ready: threading.Event,
                 sizing: queue.SimpleQueue[dict[str, Any]]) -> None:
        import jax
        from jax.experimental import transfer

        from jaxcpp.runtime import compile_guard
        from jaxcpp.runtime.kv_transport import KVTransport

        compile_guard.install()
        self._compilations_at_start = compile_guard.num_compilations()
        self.conn = conn
        self.index = index
        num_stages = self._num_stages = setup["num_stages"]
        _join_coordinator(setup["coordinator"], my_ip, index, num_stages,
                          setup["config"]["parallel"]["distributed_heartbeat_timeout_s"])
        if setup.get("cores"):
            run_forwards_inline_on_cores(setup["cores"])
        self._send({"op": "backend", "backend": jax.default_backend()})  # the head resolves --dtype auto on it
        write_own_cache_entries()  # the backend exists (it took its node id from jax.distributed)
        self.stage, built, self._kv = _stage(index, num_stages, setup["config"], sizing.get())
        self.shape = built.shape
        self._server = transfer.start_transfer_server(jax.local_devices()[0].client, host_port(my_ip, 0),
                                                      [host_port(my_ip, 0)])
        kv = jax._src.distributed.global_state.client  # the coordination service's key-value store
        assert kv is not None, "jax.distributed.initialize() sets it"
        kv.key_value_set(f"jaxcpp/transfer/{index}", self._server.address())
        peers = {}
        for peer in _neighbours(index, num_stages):  # jax's transport aborts the process where this fails
            peers[peer] = kv.blocking_key_value_get(f"jaxcpp/transfer/{peer}", 300_000)
            check_reachable(my_ip, peers[peer], f"stage {peer}'s transfer server")
        self._prev = self._server.connect(peers[index - 1]) if index > 0 else None
        self._kv_transport = KVTransport(my_ip, self._server) if self._kv is not None else None
        # async scheduling: the first stage reads the last's tokens
        self._last = self._server.connect(peers[num_stages - 1]) if index == 0 and num_stages > 1 else None
        self._recent_tokens: dict[int, Any] = {}  # first stage: tokens a step in flight may feed back
        self._attention_free_ready: set[int] = set()
        self._idle_since = 0.0
        ready.set()
        self._send({"op": "ready", "devices": [str(d) for d in self.stage.devices],
                    "layers": list(self.stage.layers), "transfer": self._server.address(),
                    "dtype": built.spec.config.dtype, "num_pages": built.num_pages})

    def _send(self, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:  # type: ignore[assignment]
        """Every message carries the stage's compile count, so the head knows it without asking."""
        from jaxcpp.runtime import compile_guard

        n = compile_guard.num_compilations() - self._compilations_at_start
        wire.send(self.conn, {**header, "compilations": n}, arrays)

    # ---- the control loop ----------------------------------------------------------------------
    def loop(self) -> int:
        handlers = {"step": self._step, "warmup": self._warmup, "attention_free": self._attention_free,
                    "offer_kv": self._offer_kv}
        while True:
            self._idle_since = time.perf_counter()  # waiting for the head: what follows is channel latency
            try:
                header, arrays = wire.recv(self.conn)
            except (EOFError, OSError):
                log.error("stage %d: the head's control channel closed; exiting", self.index)
                os._exit(1)  # no jax shutdown barrier: the group is gone
            if header["op"] == "stop":
                self.conn.close()
                os._exit(0)
            try:
                handlers[header["op"]](header, arrays)
            except Exception as e:
                log.exception("stage %d failed %s %s", self.index, header["op"], header.get("id"))
                self._send({"op": "error", "id": header.get("id", -1), "message": repr(e)})
                os._exit(1)

    def _step(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        import jax

        from jaxcpp.runtime.stage import StageInput

        received = time.perf_counter()
        step_id, num_tokens = header["id"], header["num_tokens"]
        batch = StageInput(jax.device_put(arrays[0], self.stage.replicated), _layout(header["layout"]),
                           header.get("needs_full_sampler", False))
        if header.get("bitmask") and self.stage.is_last:  # the sampler's allowed tokens (jaxcpp.structured)
            batch = batch._replace(bitmask=jax.device_put(arrays[1], self.stage.replicated))
        pull_start = time.perf_counter()
        self._drain_tokens(header.get("drain_tokens", ()))
        fed_back = self._feedback(step_id, header["feedback_from"])
        hidden = self._pull(step_id, num_tokens) if self._prev is not None else None
        jax.block_until_ready((batch.packed, hidden, fed_back))
        inputs_ready = time.perf_counter()
        out = self.stage.run(batch, hidden, fed_back)
        jax.block_until_ready(out)
        done = time.perf_counter()
        self._send({"op": "timing", "id": step_id, "stage": self.index, "num_tokens": num_tokens,
                    "idle_since": self._idle_since, "received": received, "pull_start": pull_start,
                    "inputs_ready": inputs_ready, "start": inputs_ready, "done": done})
        if not self.stage.is_last:
            self._server.await_pull(transfer_id(step_id), out)
            return
        if header.get("offer_tokens"):
            self._server.await_pull(transfer_id(step_id), out.tokens)  # before the result: a drain never waits
        elif self.stage.is_first:  # one stage: first and last
            self._recent_tokens[step_id] = out.tokens
        wants = {"tokens": header["want_tokens"], "logits": header["want_logits"],
                 "logprobs": header.get("want_logprobs", False),
                 "prompt_logprobs": header.get("want_prompt_logprobs", False)}
        if not any(wants.values()):
            return  # a step of middle prompt chunks: its timing record is all the head waits for
        parts = {"tokens": [out.tokens], "logits": [out.logits], "logprobs": out.sampled[1:],
                 "prompt_logprobs": self.stage.run_prompt_logprobs(out) if wants["prompt_logprobs"] else ()}
        result = [np.asarray(a) for name, wanted in wants.items() if wanted for a in parts[name]]
        self._send({"op": "result", "id": step_id, **wants}, result)

    def _feedback(self, step_id: int, source: int | None) -> Any:
        """The first stage's fed-back tokens. With one stage they are at hand; otherwise they are pulled
        from the last stage, which offered them when it sampled them, so the pull waits for step
        `source` only. Kept for the steps still in flight: two steps may feed back from one."""
        if not self.stage.is_first:
            return None
        for old in [t for t in self._recent_tokens if t < step_id - self._num_stages - 1]:
            del self._recent_tokens[old]  # the head feeds back only from steps in flight (<= P + 1)
        if source is None:
            return None
        if source not in self._recent_tokens:
            self._recent_tokens[source] = self._last.pull(transfer_id(source), self.stage.tokens_aval())  # type: ignore[union-attr]
        return self._recent_tokens[source]

    def _drain_tokens(self, step_ids: Any) -> None:
        """Take the offers no step will feed back from, so the last stage lets go of them."""
        if step_ids and self._last is not None:
            import jax

            jax.block_until_ready([self._last.pull(transfer_id(t), self.stage.tokens_aval()) for t in step_ids])

    def _pull(self, step_id: int, num_tokens: int) -> Any:
        return self._prev.pull(transfer_id(step_id), self.stage.hidden_aval(num_tokens))  # type: ignore[union-attr]

    def _zeros(self, num_tokens: int) -> Any:
        import jax

        if self.stage.is_first:
            return None
        aval = self.stage.hidden_aval(num_tokens)
        return jax.device_put(np.zeros(aval.shape, aval.dtype), aval.sharding)

    def _put(self, num_tokens: int) -> Any:
        import jax

        from jaxcpp.core.step_input import pack, padding_step
        from jaxcpp.runtime.stage import StageInput

        buf, layout = pack(padding_step(num_tokens, self.shape))
        return StageInput(jax.device_put(buf, self.stage.replicated), layout)

    def _warmup(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Every bucket's program, compiled here (as in one process) while the other stages compile
        theirs, then each run once."""
        import jax

        from jaxcpp.runtime.stage_ops import compile_buckets

        buckets = self.shape.buckets
        compile_buckets([self.stage], self.shape, lambda b: self._send(
            {"op": "compiled", "stage": self.index, "bucket": b.index, "of": len(buckets), "num_tokens": b.num_tokens,
             "seconds": b.seconds, "programs": b.programs, "from_cache": b.from_cache}), self._kv)
        for num_tokens in buckets:
            jax.block_until_ready(self.stage.run(self._put(num_tokens), self._zeros(num_tokens)))
        self._send({"op": "reply", "what": "warmup"})

    def _offer_kv(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """A producer's request has sampled: this stage's layers of its pages, offered to the consumer."""
        from jaxcpp.runtime.kv_transport import gather_offer

        assert self._kv is not None and self._kv_transport is not None, "the head offers only with kv settings"
        self._kv_transport.offer(header["id"], gather_offer([self.stage], header["pages"]), self._kv.transfer_timeout_s)

    def _attention_free(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """The calibration sweep's forward, timed around the model call with its inputs ready."""
        from jaxcpp.runtime.stage_ops import time_attention_free

        num_tokens = header["num_tokens"]
        first_use = num_tokens not in self._attention_free_ready
        self._attention_free_ready.add(num_tokens)
        seconds, _ = time_attention_free(self.stage, self._put(num_tokens), self._zeros(num_tokens), first_use)
        self._send({"op": "reply", "what": "attention_free", "seconds": seconds})


def write_own_cache_entries() -> None:
    """Let this stage write its programs to the persistent compilation cache. jax writes entries from
    process 0 only (SPMD processes compile the same programs: one writer is enough), but a pipeline's
    stages compile each their own (MPMD), so a stage > 0 found none of its programs on a warm start and
    compiled every bucket again (PP 2: stage 0 "loaded bucket i/n from the compilation cache" in 3 s,
    stage 1 "compiled bucket i/n" in 22 s). That check reads jax.distributed's process id when it writes;
    the only other readers are the backend's creation (done: call this after it) and computations that
    span processes (a stage's never do)."""
    from jax._src import distributed

    distributed.global_state.process_id = 0


def transfer_id(step_id: int) -> int:
    """The step's id as the transfer server takes it (unsigned): its two's complement, so a head's own
    warm-up step (id < 0) crosses too."""
    return step_id % 2**64


def _neighbours(index: int, num_stages: int) -> list[int]:
    """The stages whose transfer servers this one exchanges with: the next and previous stages, and
    the first and last (fed-back tokens); jax's transport connects both ways between them."""
    last = num_stages - 1
    peers = {index - 1, index + 1} | ({last} if index == 0 else set()) | ({0} if index == last else set())
    return sorted(p for p in peers if 0 <= p < num_stages and p != index)


def _join_coordinator(coordinator: str, my_ip: str, index: int, num_stages: int, heartbeat_timeout_s: int) -> None:
    """jax.distributed.initialize, with its failures named: stage 0's process hosts the service, a later
    stage first checks that it can reach it (else jax waits minutes, then aborts the process).

    The service's failure detector aborts every stage when one sends no heartbeat for
    `heartbeat_timeout_s` (--distributed-heartbeat-timeout-s). At 10 s it was the failure: a PP 2 server
    warming up beside other CPU-heavy work was aborted ("tasks are unhealthy (stopped sending
    heartbeats)"), both stages SIGABRT. A dead stage is noticed by its control connection instead, within
    milliseconds; this timeout only catches a stage that hangs without dying."""
    import jax

    if index > 0:
        check_reachable(my_ip, coordinator, "the jax.distributed coordinator", wait_s=COORDINATOR_WAIT_S)
    # jax binds the service to every interface; on one host nothing outside it needs to reach it
    bind = coordinator if is_loopback(split_host_port(coordinator)[0]) else None
    try:
        jax.distributed.initialize(coordinator, num_processes=num_stages, process_id=index,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s, coordinator_bind_address=bind)
    except Exception as e:  # noqa: BLE001 - jax raises its runtime's errors; name the coordinator
        raise ConnectionError(f"jax.distributed.initialize (process {index} of {num_stages}) with the "
                              f"coordinator at {coordinator} failed: {e}") from e


def _layout(fields: list[list[Any]]) -> Any:
    from jaxcpp.core.step_input import Field

    return tuple(Field(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in fields)


def _stage(index: int, num_stages: int, config_dict: dict[str, Any], sizing_message: dict[str, Any]
           ) -> tuple[Any, Any, Any]:
    """This stage (`stage_ops.build_stage`) on this process's devices, the sizing it was built with (the
    head's, so dtype, pages and buckets agree), and its part in disaggregation (KVSettings or None)."""
    import jax

    from jaxcpp.config import ENGINE_SECTIONS, EngineConfig
    from jaxcpp.core.sizing import EngineSizing
    from jaxcpp.models.spec import resolve_model_spec
    from jaxcpp.runtime.mesh import make_mesh, stage_mesh
    from jaxcpp.runtime.stage_ops import build_stage

    config = EngineConfig(**{name: cls(**config_dict[name]) for name, cls in ENGINE_SECTIONS.items()})
    sizing = EngineSizing.from_message(sizing_message, resolve_model_spec(config.model.model, config.model.dtype))
    mesh = stage_mesh(make_mesh(1, config.parallel.tensor_parallel_size, jax.local_devices()), 0)
    stage = build_stage(index, num_stages, mesh, config, sizing)
    log.info("stage %d of %d (pid %d) loaded: layers %d-%d on %s", index, num_stages, os.getpid(),
             stage.layers[0], stage.layers[1] - 1, ",".join(str(d) for d in stage.devices))
    return stage, sizing, config.kv_transfer.settings()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one jaxcpp pipeline stage (started by the head)")
    parser.add_argument("--control", required=True, help="host:port of the head's control channel")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--advertise-address", required=True,
                        help="this host's address: the transfer server binds and publishes it")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("JAXCPP_STAGE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s stage {args.stage} %(levelname)s %(name)s: %(message)s")
    return serve_stage(args.control, args.stage, args.advertise_address, parent_pid=args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
