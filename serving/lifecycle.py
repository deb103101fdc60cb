"""Start-up and shutdown of the server: both front ends (gRPC and the OpenAI HTTP API) around one engine.

Start-up (`jaxcpp serve`): the gRPC server and its health service start first, NOT_SERVING, and the
service's own RPCs answer UNAVAILABLE "warming up" (`serving/grpc_edge.py`'s `WarmUpGate`; HTTP answers
503); the engine is built (loading the model, compiling every bucket) in a worker thread while the loop
keeps answering probes (`Server.build_engine`); once it is attached, health turns SERVING. An
orchestrator's startup and readiness probes therefore see the pod alive but not ready during the compile.

Shutdown (`Server.stop`): health goes NOT_SERVING (and answers so for the first second), then new calls
are refused (UNAVAILABLE, 503), calls in flight get the rest of `--shutdown-grace-s` to finish; the
requests still running then are aborted in the engine, so their streams end normally with finish reason
ABORT; then the engine thread stops. `serve` runs it all in a process, stopping on SIGTERM or SIGINT.

One asyncio loop runs both front ends, one thread the engine (`EngineLoop`); what a call goes through
between them is `serving/admission.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health, health_pb2

from jaxcpp.config import ServerConfig
from jaxcpp.core.outputs import ModelInfo
from jaxcpp.serving.admission import Admission
from jaxcpp.serving.chat_template import ChatTemplate, load_chat_template
from jaxcpp.serving.disaggregation import connect_producers
from jaxcpp.serving.engine_loop import Engine, EngineLoop
from jaxcpp.serving.grpc_edge import WarmUpGate, grpc_server
from jaxcpp.serving.metrics import ServingMetrics
from jaxcpp.serving.openai_server import OpenAIServer
from jaxcpp.serving.security import check_files, resolve_api_key
from jaxcpp.serving.server import SERVICE_NAME, JaxcppServicer

log = logging.getLogger(__name__)

_ABORT_FLUSH_S = 5.0  # after the grace period: time for the ABORT messages to reach clients


class Server:
    """Both front ends around one engine. Create and use it inside a running asyncio loop.

    Given an engine, `start()` serves it at once. Given None, `start()` serves health (NOT_SERVING)
    and "warming up" answers until `build_engine(factory)` or `attach_engine(engine)` is awaited.
    """

    drain_announce_s = 1.0  # see stop(); a Watch-ing client gets NOT_SERVING pushed within milliseconds

    def __init__(self, engine: Engine | None, config: ServerConfig) -> None:
        check_files(config)  # a missing certificate or key file fails here, before the model loads
        self.config = config
        self.api_key = resolve_api_key(config)  # read once: both front ends and a consumer's producer calls
        self.metrics = ServingMetrics()
        self.health = health.aio.HealthServicer()
        self.admission = Admission(config, self.metrics)  # one registry and queue limit for both
        self.servicer = JaxcppServicer(config, self.metrics, self.admission)
        self.http = OpenAIServer(config, self.metrics, self.admission, self.api_key) if config.enable_http else None
        self.engine_loop: EngineLoop | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._engine = engine
        self._gate = WarmUpGate()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self.engine_failure: BaseException | None = None  # the engine's (or its executor's) fatal error
        self.engine_failed = asyncio.Event()  # set on the server's loop when it happened

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def num_in_flight(self) -> int:
        """Calls held by both front ends."""
        return self.admission.num_in_flight

    async def start(self) -> int:
        """Start the front ends (and the engine thread, if given an engine); returns the bound gRPC port."""
        self._loop = asyncio.get_running_loop()
        if self.config.enable_grpc:
            await self._start_grpc()
        if self.http is not None:
            await self.http.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.host, self.config.metrics_port)
        if self._engine is not None:
            await self.attach_engine(self._engine)
        return self.port

    async def _start_grpc(self) -> None:
        server, self.port = grpc_server(self.config, self.servicer, self.health, self._gate, self.api_key)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # HealthServicer starts SERVING
        await server.start()
        self._server = server

    async def build_engine(self, factory: Callable[[], Engine]) -> None:
        """Build the engine with `factory()` off the loop (probes keep answering), then attach it.

        A daemon thread, not the loop's executor: a SIGTERM during the compile must not wait for it.
        """
        built: Future[Engine] = Future()

        def build() -> None:
            if not built.set_running_or_notify_cancel():
                return
            try:
                built.set_result(factory())
            except BaseException as exc:  # noqa: B036 - handed to the awaiting coroutine
                built.set_exception(exc)

        threading.Thread(target=build, name="jaxcpp-engine-build", daemon=True).start()
        await self.attach_engine(await asyncio.wrap_future(built))

    async def attach_engine(self, engine: Engine) -> None:
        """Start the engine thread on `engine`, open the service and turn health SERVING (a kv_consumer's: while
        one of its producers answers SERVING, `GrpcRemotePrefill.watch_readiness`)."""
        remote = connect_producers(engine, self.api_key)  # a kv_consumer's: before requests
        self.engine_loop = EngineLoop(engine, self.metrics, on_failure=self._on_engine_failure)
        engine.add_failure_listener(self._on_engine_failure)  # a stage that dies while the engine idles
        self.engine_loop.start()
        model_info = await asyncio.wrap_future(self.engine_loop.submit(engine.model_info))
        self.admission.attach(self.engine_loop)
        self.servicer.attach(self.engine_loop, model_info)
        if self.http is not None:
            self.http.attach(self.engine_loop, model_info, engine.tokenizer, self._chat_template(engine),
                             self._served_names(model_info))
        if remote is not None:  # a consumer serves while a producer can prefill: its health follows theirs
            await asyncio.to_thread(remote.watch_readiness, self._on_producers_ready)
        self._gate.open()
        if remote is None:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _on_producers_ready(self, ready: bool) -> None:  # a watcher thread
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._set_health(status), self._loop)

    def _chat_template(self, engine: Engine) -> ChatTemplate | None:
        sizing = getattr(engine, "sizing", None)  # LLMEngine's: the model folder
        return load_chat_template(sizing.spec.folder, self.config.chat_template) if sizing is not None else None

    def _served_names(self, info: ModelInfo) -> tuple[str, ...]:
        names = [n.strip() for n in (self.config.served_model_name or "").split(",") if n.strip()]
        return tuple(names) or (info.name,)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float | None = None) -> None:
        """Turn health NOT_SERVING; then refuse new calls, let calls in flight finish within `grace`
        seconds, then abort the requests still running (their streams end with finish reason ABORT), stop.

        For the first `drain_announce_s` of the grace the server still listens and health answers
        NOT_SERVING (a probe, or a client watching health, sees the drain and moves on); then the listener
        closes (GOAWAY: connected clients reconnect elsewhere) and the calls in flight get the rest.
        """
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self._loop is not None:  # started
            announce = min(self.drain_announce_s, grace)
            if self.http is not None:
                self.http.close()  # /health answers 503 at once, new requests too
            await asyncio.sleep(announce)
            self.servicer.close()
            # gRPC refuses new calls from now on and cancels what is left after the grace + a flush (of
            # the ABORT messages; before there is an engine no call of ours can be waiting for one)
            flush = _ABORT_FLUSH_S if self.engine_loop is not None else 0.0
            stopping = asyncio.ensure_future(self._server.stop(grace - announce + flush)) \
                if self._server is not None else None
            if not await self._drained(grace - announce) and self.engine_loop is not None:
                log.info("grace period over: aborting %d calls still running", self.num_in_flight)
                self.engine_loop.abort_all_with_final_output()
                await self._drained(_ABORT_FLUSH_S)  # HTTP streams send their last (abort) chunks
            if stopping is not None:
                await stopping
            if self.http is not None:
                await self.http.stop()
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop, 30.0)
        self.metrics.close()

    async def _drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.num_in_flight

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_engine_failure(self, exc: BaseException) -> None:  # engine thread (or an executor's listener)
        self.engine_failure = self.engine_failure or exc
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self._loop)
            self._loop.call_soon_threadsafe(self.engine_failed.set)


class ServerThread:
    """A `Server` on its own asyncio loop in a background thread: for tests and embedding.

        with ServerThread(engine, ServerConfig(port=0)) as server:
            Client(f"127.0.0.1:{server.port}")
    """

    def __init__(self, engine: Engine | None, config: ServerConfig) -> None:
        self.server = Server(engine, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxcpp-grpc", daemon=True)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def http_port(self) -> int | None:
        return self.server.http_port

    def start(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=120)
        return self

    def build_engine(self, factory: Callable[[], Engine]) -> Future[None]:
        """`Server.build_engine` on the server's loop; the future resolves once health is SERVING."""
        return asyncio.run_coroutine_threadsafe(self.server.build_engine(factory), self._loop)

    def stop(self, grace: float | None = 0.0) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(timeout=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(engine_factory: Callable[[], Engine], config: ServerConfig,
                on_ready: Callable[[Server], None] | None = None,
                on_listening: Callable[[Server], None] | None = None) -> int:
    """Listen (health NOT_SERVING), build the engine, serve it until SIGTERM or SIGINT, then drain.

    Returns the exit code: 0, also for a signal during warm-up (nothing to drain then); 1 when the engine
    failed while serving (its requests already got INTERNAL, health NOT_SERVING): the orchestrator
    restarts the process (e.g. a pipeline stage process died). An engine that fails to build stops the
    server and raises.
    """
    import signal

    server = Server(None, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_listening is not None:
        on_listening(server)
    building = asyncio.ensure_future(server.build_engine(engine_factory))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((building, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not building.done():
        log.info("stopped during warm-up")
        building.cancel()
        await server.stop(0)
        return 0
    if building.exception() is not None:
        stopping.cancel()
        await server.stop(0)
        building.result()  # raises the factory's error
    if on_ready is not None:
        on_ready(server)
    failed = asyncio.ensure_future(server.engine_failed.wait())
    await asyncio.wait((stopping, failed), return_when=asyncio.FIRST_COMPLETED)
    if failed.done() and not stopping.done():  # exit non-zero so that an orchestrator restarts the group
        log.error("engine failed (%r): stopping with exit code 1", server.engine_failure)
        stopping.cancel()
        await server.stop(0)
        return 1
    failed.cancel()
    log.info("shutting down: %d requests in flight, %.1f s grace", server.num_in_flight,
             config.shutdown_grace_s)
    await server.stop()
    return 0
