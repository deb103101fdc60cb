"""The one thread that owns the engine.

The engine is not thread-safe, so every call into it happens here. Other threads hand work over as
commands (`submit(fn)` returns a future; `add` and `abort` are commands too); the loop runs all queued
commands, then one `engine.step()`, and hands each output to the sink its request registered. Commands
run between steps, so an abort takes effect before the next step. When there is nothing to step, the
loop sleeps on the command queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from jaxcpp.core.outputs import EngineStats, ModelInfo, RequestOutput
from jaxcpp.output_processor import RequestState
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

# Called on the engine thread with each output of a request, or with the exception that killed
# the engine. Must be quick and must not block (the server's sinks post to an asyncio loop).
Sink = Callable[[RequestOutput | BaseException], None]

_STATS_INTERVAL_S = 0.05  # refresh the metrics' stats snapshot at most this often while busy


class Engine(Protocol):
    """What the server needs from `jaxcpp.core.engine.LLMEngine` (tests run it on a fake executor)."""

    tokenizer: Any

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, group: str | None = None, kv_transfer: Any = None) -> None: ...
    def abort_request(self, request_id: str, reason: str = "abort") -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def model_info(self) -> ModelInfo: ...
    def add_failure_listener(self, callback: Callable[[BaseException], None]) -> None: ...
    def close(self) -> None: ...


class _Command:
    def __init__(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        self.fn = fn
        self.future = future

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # noqa: B036 - handed to the caller through the future
            self.future.set_exception(exc)


class EngineFailedError(RuntimeError):
    """engine.step() raised; the loop stopped and every request was failed with this error."""


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServingMetrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}          # engine thread only
        self._thread = threading.Thread(target=self._run, name="jaxcpp-engine-loop", daemon=True)
        self._last_stats_time = 0.0
        self.failure: BaseException | None = None
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, stop the thread and wait for it, then close the engine."""
        if self._thread.is_alive():
            self.submit(self._abort_all)
            self._commands.put(None)
            self._closed = True
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # -- commands (any thread) -------------------------------------------------------------------
    def unready_reason(self) -> str | None:
        """Why requests cannot be served now though the engine runs (a kv_consumer none of whose producers is
        ready: `RemotePrefill.unready_reason`), or None."""
        remote = getattr(self.engine, "remote", None)
        return remote.unready_reason() if remote is not None else None

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn()` on the engine thread before the next step; its result or error lands in the future."""
        future: Future[T] = Future()
        if self.failure is not None:
            future.set_exception(EngineFailedError(f"engine failed: {self.failure!r}"))
        elif self._closed:
            future.set_exception(EngineFailedError("the engine loop was stopped"))
        else:
            self._commands.put(_Command(fn, future))
        return future

    def add_samples(self, state: RequestState, prompt: str | list[int], sink: Sink,
                    kv_transfer: Any = None) -> Future[None]:
        """Admit a client request's engine requests (its n samples) together, or none of them.
        `kv_transfer`: a consumer's prefill on this producer (`KVTransferRequest`; n is 1)."""

        def add() -> None:
            added: list[str] = []
            # only what is set: n > 1 samples share a group, a producer's prefill carries its transfer
            extra: dict[str, Any] = {k: v for k, v in (("group", state.group), ("kv_transfer", kv_transfer))
                                     if v is not None}
            try:
                for request_id, params in state.engine_requests:
                    self.engine.add_request(request_id, prompt, params, **extra)
                    added.append(request_id)
            except BaseException:
                for request_id in added:
                    self.engine.abort_request(request_id)
                raise
            self._sinks.update(dict.fromkeys(added, sink))

        return self.submit(add)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request (no-op if finished or unknown); its sink gets nothing more. `reason` is what
        the metrics count it as ("stop" for a stop string the edge matched)."""

        def abort() -> None:
            if self._sinks.pop(request_id, None) is not None:
                if reason == "abort":
                    self.engine.abort_request(request_id)
                else:
                    self.engine.abort_request(request_id, reason)
                self._publish_stats(force=True)

        self.submit(abort)

    def abort_all_with_final_output(self) -> None:
        """Abort every request but keep its sink: each stream gets the final "abort" output."""

        def abort_all() -> None:
            for request_id in list(self._sinks):
                self.engine.abort_request(request_id)

        self.submit(abort_all)

    # -- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._run_commands(block=not self.engine.has_unfinished_requests()):
                return
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: B036 - fail every request, then stop
                self._fail(exc)
                return
            self._dispatch(outputs)
            self._publish_stats(force=not self.engine.has_unfinished_requests())  # idle: exact

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            command.run()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if out.finished and self._metrics is not None:
                self._metrics.observe_finished(out)
            if sink is not None:
                sink(out)

    def _publish_stats(self, force: bool) -> None:
        now = time.monotonic()
        if self._metrics is not None and (force or now - self._last_stats_time >= _STATS_INTERVAL_S):
            self._last_stats_time = now
            self._metrics.set_stats(self.engine.stats())

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
        self._sinks.clear()

    def _fail(self, exc: BaseException) -> None:
        log.exception("engine step failed; failing %d requests and stopping", len(self._sinks))
        self.failure = exc
        for sink in self._sinks.values():
            sink(exc)
        self._sinks.clear()
        error = EngineFailedError(f"engine failed: {exc!r}")
        while True:  # commands queued before `failure` was set would otherwise never answer
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)
        if self._on_failure is not None:
            self._on_failure(exc)
