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
    5. loop over control messages (`jaxcpp.pipe.wire`), in order:
         step      -> put the packed step on its devices, pull the activations of the same micro-batch
                      from stage S-1 (`jax.experimental.transfer`), run, time the model call, then
                      offer its output to stage S+1 (await_pull) or, on the last stage, send tokens
                      (and logits when asked) to the head; every stage sends its timing record
         warmup    -> compile every bucket on its own (zero activations), all stages in parallel
         attention_free / count / stop

Activations go stage to stage; the head only ever sees the few-KB step and the last stage's tokens.
The process exits when the head says stop, when the control channel closes (the head died), or when
its parent (a spawning head) is gone: no orphans. A spawned stage ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group): the head drains and stops it. Steps 1-3's set-up (the channel, the
devices and cores, the parent, the coordinator) is `jaxcpp.runtime.stage_setup`; this module is the
worker and its loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from jaxcpp.pipe import wire
from jaxcpp.pipe.cluster import check_local, check_reachable, host_port, shared_control_key, split_host_port
from jaxcpp.runtime.stage_setup import (
    configure_process,
    connect,
    join_coordinator,
    leave_ctrl_c_to_the_head,
    neighbours,
    run_forwards_inline_on_cores,
    watch_head_while_starting,
    watch_parent,
    write_own_cache_entries,
)

log = logging.getLogger("jaxcpp.stage")

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
        join_coordinator(setup["coordinator"], my_ip, index, num_stages,
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
        for peer in neighbours(index, num_stages):  # jax's transport aborts the process where this fails
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
                    "dtype": built.spec.config.dtype, "num_pages": built.num_pages,
                    "mla_rebuild_weight": self.stage.mla_rebuild_weight})

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
        batch = StageInput(self.stage.put(arrays[0]), _layout(header["layout"]),
                           header.get("needs_full_sampler", False), num_seqs=header.get("num_seqs"))
        if header.get("bitmask") and self.stage.is_last:  # the sampler's allowed tokens (jaxcpp.structured)
            batch = batch._replace(bitmask=arrays[1])  # a host array: the sampler's call takes it
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
        from jaxcpp.core.step_input import pack, padding_step
        from jaxcpp.runtime.stage import StageInput

        buf, layout = pack(padding_step(num_tokens, self.shape))
        return StageInput(self.stage.put(buf), layout)

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


def transfer_id(step_id: int) -> int:
    """The step's id as the transfer server takes it (unsigned): its two's complement, so a head's own
    warm-up step (id < 0) crosses too."""
    return step_id % 2**64


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
