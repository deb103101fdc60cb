"""One pipeline stage in its own OS process: the stage side of the multi-process executor.

    python -m jaxcpp.runtime.stage_process --control HOST:PORT --stage S --advertise-address IP [--parent-pid PID]
    (or `jaxcpp serve --num-processes N --process-id S ...` on host S > 0, which calls serve_stage)

How a stage process comes up and runs:

    1. connect to the head's control channel (TCP, HMAC-authenticated; retried until the head is up),
       say hello (stage index, pid, host, the address it advertises), receive the head's EngineConfig
       and the coordinator address
    2. set its own device count (XLA_FLAGS, T devices for TP inside the stage) and, when it is to be
       pinned, single-threaded XLA:CPU; only then import jax (and pin, once the jax client exists)
    3. jax.distributed.initialize(coordinator, P, S): stage 0's process hosts the coordination service
       (a later stage first checks that it can reach it); build its `Stage` from its own layers
       (`load_stage_params`); start its transfer server on the advertised address and publish it in
       the service's key-value store, check that it can connect to its neighbours' (`cluster`), and
       connect to the previous stage's (discovery through jax.distributed, not a home-made protocol)
    4. tell the head it is ready (with its transfer server's address); until then a message or a
       closed channel from the head means the head gave up: the stage exits instead of waiting for peers
    5. loop over control messages (`jaxcpp.runtime.wire`), in order:
         step      -> put the packed step on its devices, pull the activations of the same micro-batch
                      from stage S-1 (`jax.experimental.transfer`), run, time the model call, then
                      offer its output to stage S+1 (await_pull) or, on the last stage, send tokens
                      (and logits when asked) to the head; every stage sends its timing record
         warmup    -> compile every bucket on its own (zero activations), all stages in parallel
         attention_free / count / stop

Activations go stage to stage; the head only ever sees the few-KB step and the last stage's tokens.
The process exits when the head says stop, when the control channel closes (the head died), or when
its parent (a spawning head) is gone: no orphans.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any

import numpy as np

from jaxcpp.runtime import wire
from jaxcpp.runtime.cluster import (
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


def pin_to_cores(cores: list[int]) -> None:
    """Every thread of this process, and so every thread it starts later, on `cores` only.

    Called once the jax client exists, never before: XLA:CPU sizes its client thread pool from the
    cores the process may use when the client is created, and that pool runs both the computations
    and the transfer server's sends. Pinned first, a one-core stage got a one-thread pool, and the
    send of micro-batch k waited behind the forward of k + 1 (the next stage started k only when
    this one finished k + 1). Created first, the pool keeps a thread per machine core; pinned
    afterwards, those threads share this stage's core and a send interleaves with the forward.
    """
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def watch_parent(parent_pid: int) -> None:
    """A spawned stage exits as soon as its head is gone, even while blocked on a transfer."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        os._exit(3)

    threading.Thread(target=run, name="jaxcpp-parent-watch", daemon=True).start()


def watch_head_while_starting(conn: Any, stage: int) -> threading.Event:
    """Until this stage says ready the head sends nothing but `stop`, so anything readable (or a closed
    channel) means the head gave up: exit rather than wait on a peer or a barrier that never comes.
    Set the returned event just before sending ready (or an error)."""
    ready = threading.Event()

    def run() -> None:
        while not ready.is_set():
            try:
                if not conn.poll(0.25) or ready.is_set():
                    continue
                stopped = wire.recv(conn)[0]["op"] == "stop"
            except (EOFError, OSError):
                stopped = False
            log.error("stage %d: the head %s during start-up; exiting", stage,
                      "stopped the pipeline" if stopped else "closed the control channel")
            os._exit(0 if stopped else 1)

    threading.Thread(target=run, name="jaxcpp-start-watch", daemon=True).start()
    return ready


def serve_stage(control: str, stage: int, advertise: str, *, parent_pid: int | None = None) -> int:
    """Run stage `stage` until the head stops it; the exit code (0 when stopped by the head). `advertise`:
    this host's address, which the stage's transfer server binds and publishes (`cluster`)."""
    host, port = split_host_port(control)
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
    ready = watch_head_while_starting(conn, stage)
    try:
        check_local(advertise)
        worker = StageWorker(conn, stage, setup, advertise, ready)
    except Exception as e:  # loading, placing or reaching a peer failed: the head names it and gives up
        ready.set()  # this process ends with its own exit code, not the watcher's
        message = str(e) if isinstance(e, ConnectionError) else repr(e)
        log.error("stage %d failed to start: %s", stage, message, exc_info=not isinstance(e, ConnectionError))
        wire.send(conn, {"op": "error", "id": -1, "message": f"start-up failed: {message}"})
        return 1
    return worker.loop()


class StageWorker:
    """Everything below runs after jax is configured for this process (configure_process)."""

    def __init__(self, conn: Any, index: int, setup: dict[str, Any], my_ip: str, ready: threading.Event) -> None:
        import jax
        from jax.experimental import transfer

        from jaxcpp.runtime import compile_guard

        compile_guard.install()
        self._compilations_at_start = compile_guard.num_compilations()
        self.conn = conn
        self.index = index
        num_stages = self._num_stages = setup["num_stages"]
        _join_coordinator(setup["coordinator"], my_ip, index, num_stages)
        if setup.get("cores"):
            jax.devices()  # creates the client and its thread pools before the process is pinned
            pin_to_cores(setup["cores"])
        self.stage, self.shape = _build_stage(index, num_stages, setup["config"])
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
        # async scheduling: the first stage reads the last's tokens
        self._last = self._server.connect(peers[num_stages - 1]) if index == 0 and num_stages > 1 else None
        self._recent_tokens: dict[int, Any] = {}  # first stage: tokens a step in flight may feed back
        self._attention_free_ready: set[int] = set()
        self._idle_since = 0.0
        ready.set()
        self._send({"op": "ready", "devices": [str(d) for d in self.stage.devices],
                    "layers": list(self.stage.layers), "transfer": self._server.address()})

    def _send(self, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:  # type: ignore[assignment]
        """Every message carries the stage's compile count, so the head knows it without asking."""
        from jaxcpp.runtime import compile_guard

        n = compile_guard.num_compilations() - self._compilations_at_start
        wire.send(self.conn, {**header, "compilations": n}, arrays)

    # ---- the control loop ----------------------------------------------------------------------
    def loop(self) -> int:
        handlers = {"step": self._step, "warmup": self._warmup, "attention_free": self._attention_free}
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
        ticket, num_tokens = header["id"], header["num_tokens"]
        batch = StageInput(jax.device_put(arrays[0], self.stage.replicated), _layout(header["layout"]),
                           header.get("needs_full_sampler", False))
        pull_start = time.perf_counter()
        self._drain_tokens(header.get("drain_tokens", ()))
        fed_back = self._feedback(ticket, header["feedback_from"])
        hidden = self._pull(ticket, num_tokens) if self._prev is not None else None
        jax.block_until_ready((batch.packed, hidden, fed_back))
        inputs_ready = time.perf_counter()
        out = self.stage.run(batch, hidden, fed_back)
        jax.block_until_ready(out)
        done = time.perf_counter()
        self._send({"op": "timing", "id": ticket, "stage": self.index, "num_tokens": num_tokens,
                    "idle_since": self._idle_since, "received": received, "pull_start": pull_start,
                    "inputs_ready": inputs_ready, "start": inputs_ready, "done": done})
        if not self.stage.is_last:
            self._server.await_pull(ticket, out)
            return
        if header.get("offer_tokens"):
            self._server.await_pull(ticket, out.tokens)  # before the result: a drain never waits
        elif self.stage.is_first:  # one stage: first and last
            self._recent_tokens[ticket] = out.tokens
        wants = {"tokens": header["want_tokens"], "logits": header["want_logits"],
                 "logprobs": header.get("want_logprobs", False),
                 "prompt_logprobs": header.get("want_prompt_logprobs", False)}
        if not any(wants.values()):
            return  # a step of middle prompt chunks: its timing record is all the head waits for
        parts = {"tokens": [out.tokens], "logits": [out.logits], "logprobs": out.sampled[1:],
                 "prompt_logprobs": self.stage.run_prompt_logprobs(out) if wants["prompt_logprobs"] else ()}
        result = [np.asarray(a) for name, wanted in wants.items() if wanted for a in parts[name]]
        self._send({"op": "result", "id": ticket, **wants}, result)

    def _feedback(self, ticket: int, source: int | None) -> Any:
        """The first stage's fed-back tokens. With one stage they are at hand; otherwise they are pulled
        from the last stage, which offered them when it sampled them, so the pull waits for step
        `source` only. Kept for the steps still in flight: two steps may feed back from one."""
        if not self.stage.is_first:
            return None
        for old in [t for t in self._recent_tokens if t < ticket - self._num_stages - 1]:
            del self._recent_tokens[old]  # the head feeds back only from steps in flight (<= P + 1)
        if source is None:
            return None
        if source not in self._recent_tokens:
            self._recent_tokens[source] = self._last.pull(source, self.stage.tokens_aval())  # type: ignore[union-attr]
        return self._recent_tokens[source]

    def _drain_tokens(self, tickets: Any) -> None:
        """Take the offers no step will feed back from, so the last stage lets go of them."""
        if tickets and self._last is not None:
            import jax

            jax.block_until_ready([self._last.pull(t, self.stage.tokens_aval()) for t in tickets])

    def _pull(self, ticket: int, num_tokens: int) -> Any:
        return self._prev.pull(ticket, self.stage.hidden_aval(num_tokens))  # type: ignore[union-attr]

    def _zeros(self, num_tokens: int) -> Any:
        import jax

        if self.stage.is_first:
            return None
        aval = self.stage.hidden_aval(num_tokens)
        return jax.device_put(np.zeros(aval.shape, aval.dtype), aval.sharding)

    def _put(self, num_tokens: int) -> Any:
        import jax

        from jaxcpp.runtime.stage import StageInput
        from jaxcpp.step_input import pack, padding_step

        buf, layout = pack(padding_step(num_tokens, self.shape))
        return StageInput(jax.device_put(buf, self.stage.replicated), layout)

    def _warmup(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Every bucket's program, compiled here (`COMPILE_THREADS` at a time, as in one process) while
        the other stages compile theirs, then each run once."""
        from concurrent.futures import ThreadPoolExecutor

        import jax

        from jaxcpp.runtime.pipeline import COMPILE_THREADS

        buckets = self.shape.buckets

        def compile_bucket(num_tokens: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            self.stage.compile(self.shape, num_tokens)
            return num_tokens, time.perf_counter() - t0

        with ThreadPoolExecutor(min(COMPILE_THREADS, len(buckets)), thread_name_prefix="jaxcpp-compile") as pool:
            for i, (num_tokens, seconds) in enumerate(pool.map(compile_bucket, buckets), 1):
                self._send({"op": "compiled", "stage": self.index, "bucket": i, "of": len(buckets),
                            "num_tokens": num_tokens, "seconds": seconds})
        for num_tokens in buckets:
            jax.block_until_ready(self.stage.run(self._put(num_tokens), self._zeros(num_tokens)))
        self._send({"op": "reply", "what": "warmup"})

    def _attention_free(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """The calibration sweep's forward, timed around the model call with its inputs ready."""
        import jax

        num_tokens = header["num_tokens"]
        batch, hidden = self._put(num_tokens), self._zeros(num_tokens)
        if num_tokens not in self._attention_free_ready:  # compile (and run once) untimed
            jax.block_until_ready(self.stage.run_attention_free(batch, hidden))
            self._attention_free_ready.add(num_tokens)
        jax.block_until_ready((batch.packed, hidden, self.stage.kv))
        t0 = time.perf_counter()
        jax.block_until_ready(self.stage.run_attention_free(batch, hidden))
        self._send({"op": "reply", "what": "attention_free", "seconds": time.perf_counter() - t0})


def _neighbours(index: int, num_stages: int) -> list[int]:
    """The stages whose transfer servers this one exchanges with: the next and previous stages, and
    the first and last (fed-back tokens); jax's transport connects both ways between them."""
    last = num_stages - 1
    peers = {index - 1, index + 1} | ({last} if index == 0 else set()) | ({0} if index == last else set())
    return sorted(p for p in peers if 0 <= p < num_stages and p != index)


def _join_coordinator(coordinator: str, my_ip: str, index: int, num_stages: int) -> None:
    """jax.distributed.initialize, with its failures named: stage 0's process hosts the service, a later
    stage first checks that it can reach it (else jax waits minutes, then aborts the process)."""
    import jax

    if index > 0:
        check_reachable(my_ip, coordinator, "the jax.distributed coordinator", wait_s=COORDINATOR_WAIT_S)
    # jax binds the service to every interface; on one host nothing outside it needs to reach it
    bind = coordinator if is_loopback(split_host_port(coordinator)[0]) else None
    try:
        jax.distributed.initialize(coordinator, num_processes=num_stages, process_id=index,
                                   heartbeat_timeout_seconds=10, coordinator_bind_address=bind)
    except Exception as e:  # noqa: BLE001 - jax raises its runtime's errors; name the coordinator
        raise ConnectionError(f"jax.distributed.initialize (process {index} of {num_stages}) with the "
                              f"coordinator at {coordinator} failed: {e}") from e


def _layout(fields: list[list[Any]]) -> Any:
    from jaxcpp.step_input import Field

    return tuple(Field(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in fields)


def _build_stage(index: int, num_stages: int, config_dict: dict[str, Any]) -> Any:
    """This stage's `Stage` (or its stand-in), from the head's config: the same sizing plan, so pages and
    buckets agree."""
    import jax

    from jaxcpp.config import ENGINE_SECTIONS, EngineConfig
    from jaxcpp.models.spec import resolve_model_spec
    from jaxcpp.runtime.mesh import make_mesh, stage_mesh
    from jaxcpp.sizing import EngineSizing

    config = EngineConfig(**{name: cls(**config_dict[name]) for name, cls in ENGINE_SECTIONS.items()})
    sizing = EngineSizing.plan(config, resolve_model_spec(config.model.model, config.model.dtype))
    layers = sizing.layers[index]
    mesh = stage_mesh(make_mesh(1, config.parallel.tensor_parallel_size, jax.local_devices()), 0)
    stand_in = config.parallel.stand_in_model()
    if stand_in is not None:
        from jaxcpp.runtime.stand_in import StandInStage

        stage: Any = StandInStage(index, num_stages, mesh, layers, stand_in, config.parallel.stand_in_jitter,
                                  sizing.spec.config.vocab_size, sizing.shape.max_num_seqs, config.model.seed)
    else:
        stage = _load_stage(index, num_stages, config, sizing, mesh)
    log.info("stage %d/%d (pid %d) loaded: layers %d-%d on %s", index + 1, num_stages, os.getpid(),
             layers[0], layers[1] - 1, ",".join(str(d) for d in stage.devices))
    return stage, sizing.shape


def _load_stage(index: int, num_stages: int, config: Any, sizing: Any, mesh: Any) -> Any:
    from jaxcpp.kernels.backend import select_attention
    from jaxcpp.runtime.factory import enable_compilation_cache, load_stage

    enable_compilation_cache()  # load_stage: the same weights, cache dtype and KV scales as in-process
    return load_stage(index, num_stages, config, sizing, mesh, select_attention(config.model.attention_backend))


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
