"""The start-up handshake, the head's side: every stage process connects and says hello, gets the config,
says which backend it holds; the head sizes the engine on that backend once (`--dtype auto` resolved
there) and sends the sizing; every stage builds its layers and KV pages from it and says what it built.
No jax.

    sizing = StageHandshake(config, spec, links, coordinator).run(accepted)

A stage that fails, ends or is not ready within START_TIMEOUT_S stops the start-up at once, named
(`StageLink.error`): the others may be waiting on it inside jax.distributed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import socket
import time
from multiprocessing.connection import wait as connection_wait
from typing import Any

from jaxcpp.config import EngineConfig
from jaxcpp.core.executor import ExecutorError
from jaxcpp.core.sizing import EngineSizing, dtype_on_backend
from jaxcpp.head.supervision import StageLink, how_it_ended
from jaxcpp.models.spec import ModelSpec
from jaxcpp.pipe import wire

log = logging.getLogger(__name__)

START_TIMEOUT_S = float(os.environ.get("JAXCPP_STAGE_START_TIMEOUT_S", "600"))
PIN_ENV = "JAXCPP_PIN_STAGE_CORES"   # "1": each stage on its own cores, single-threaded XLA:CPU


class StageHandshake:
    def __init__(self, config: EngineConfig, spec: ModelSpec, links: list[StageLink], coordinator: str) -> None:
        self._config = config
        self._spec = spec
        self.links = links
        self.num_stages = len(links)
        self._coordinator = coordinator
        self.sizing: EngineSizing  # set once the stages said which backend they hold

    def run(self, accepted: queue.SimpleQueue[Any]) -> EngineSizing:
        """Every stage says hello and gets the config; then each loads and places its layers. The sizing
        they all built from (ExecutorError naming the stage when one fails, ends or is late)."""
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
        return self.sizing

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
            ln.mla_rebuild_weight = header["mla_rebuild_weight"]
            if ln.sized != sized:
                raise ln.error(f"built (dtype, KV pages) {ln.sized}, the head sized {sized}")
            log.info("stage %d of %d ready: %s, layers %d-%d, devices %s", ln.index, self.num_stages,
                     ln.where(), header["layers"][0], header["layers"][1] - 1, ",".join(header["devices"]))

    def _await_all(self, op: str, deadline: float) -> list[tuple[StageLink, dict[str, Any]]]:
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

    def _start_message(self, ln: StageLink, op: str) -> dict[str, Any] | None:
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
