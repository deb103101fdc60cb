"""The gRPC server: `jaxcpp.v1.JaxcppService`, standard health and reflection, on grpc.aio.

How a Generate call moves: the handler (on the asyncio loop) validates the request, takes a slot in
the bounded queue (`--max-queue-size` calls in flight, RESOURCE_EXHAUSTED beyond), and hands the
request to the `EngineLoop` thread with a sink that posts each `RequestOutput` back onto the asyncio
loop; the handler detokenizes and streams each output as it arrives. Whatever ends the call early
(client cancel, disconnect, deadline, shutdown) cancels the handler, whose `finally` sends an abort,
which the engine thread runs before its next step. No thread per stream: one asyncio loop, one engine
thread, and prometheus-client's HTTP thread.

Start-up (`jaxcpp serve`): the gRPC server and its health service start first, NOT_SERVING, and the
service's own RPCs answer UNAVAILABLE "warming up" (`_WarmUpGate`); the engine is built (loading the
model, compiling every bucket) in a worker thread while the loop keeps answering probes
(`Server.build_engine`); once it is attached, health turns SERVING. An orchestrator's startup and
readiness probes therefore see the pod alive but not ready during the compile.

Shutdown (`Server.stop`): health goes NOT_SERVING (and answers so for the first second), then new calls
are refused, calls in flight get the rest of `--shutdown-grace-s` to finish, then are cancelled (and so
aborted); then the engine thread stops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import jaxcpp
from jaxcpp.config import ServerConfig
from jaxcpp.errors import InvalidRequestError
from jaxcpp.executor import ExecutorError
from jaxcpp.outputs import ModelInfo, RequestOutput
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.engine_loop import Engine, EngineFailedError, EngineLoop
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.metrics import ServingMetrics, split_dynamic_chunking
from jaxcpp.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxcppService"].full_name
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}
_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def sampling_params_from_proto(msg: pb.SamplingParameters) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; raises InvalidRequestError naming the field."""
    kwargs: dict[str, Any] = {name: getattr(msg, name)
                              for name in ("max_tokens", "temperature", "top_k", "top_p", "seed")
                              if msg.HasField(name)}
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, **kwargs)


def prompt_from_proto(request: pb.GenerateRequest) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    prompt: str | list[int] = request.text if kind == "text" else list(request.token_ids.ids)
    if kind is None or not prompt:
        raise InvalidRequestError("prompt", "must not be empty: set `text` or `token_ids`")
    return prompt


class _TextDeltas:
    """Text of each output's new tokens; empty when the model has no tokenizer (token ids only)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._detok: IncrementalDetokenizer | None = None

    def __call__(self, out: RequestOutput) -> str:
        if self._tokenizer is None:
            return ""
        if self._detok is None:  # the prompt's last ids give the first tokens their context
            self._detok = IncrementalDetokenizer(self._tokenizer, out.prompt_token_ids)
        text = self._detok.step(out.new_token_ids)
        return text + self._detok.flush() if out.finished else text


class JaxcppServicer(pb_grpc.JaxcppServiceServicer):
    """Registered before the engine exists; `attach` hands it the engine (`_WarmUpGate` holds calls until then)."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics) -> None:
        self._engine: EngineLoop  # set by attach()
        self._model_info: ModelInfo
        self._config = config
        self._metrics = metrics
        self._in_flight: set[str] = set()  # touched on the asyncio loop only
        self._started = time.monotonic()

    def attach(self, engine_loop: EngineLoop, model_info: ModelInfo) -> None:
        self._engine = engine_loop
        self._model_info = model_info

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            params = sampling_params_from_proto(request.sampling)
            prompt = prompt_from_proto(request)
        except InvalidRequestError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(self._in_flight) >= self._config.max_queue_size:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request queue is full: {len(self._in_flight)} requests in flight "
                               f"(--max-queue-size {self._config.max_queue_size}); retry later")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._in_flight:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: {request_id!r} is already in flight")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: RequestOutput | BaseException) -> None:  # engine thread
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        self._enter(request_id)
        finished = False
        try:
            await asyncio.wrap_future(self._engine.add(request_id, prompt, params, sink))
            text_of = _TextDeltas(self._engine.engine.tokenizer)
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    # a failed pipeline stage is the server's loss, not the request's: retry elsewhere
                    code = grpc.StatusCode.UNAVAILABLE if isinstance(out, ExecutorError) else grpc.StatusCode.INTERNAL
                    await context.abort(code, f"engine failed: {out}" if isinstance(out, ExecutorError)
                                        else f"engine failed: {out!r}")
                else:
                    finished = out.finished
                    yield self._response(request_id, out, text_of(out))
        except InvalidRequestError as exc:  # the engine refused it: nothing to abort
            finished = True
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineFailedError as exc:
            finished = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not finished:  # cancelled, disconnected, deadline, or shutdown past the grace period
                self._engine.abort(request_id)
            self._leave(request_id)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        info = self._model_info
        return pb.GetModelInfoResponse(
            name=info.name, architecture=info.architecture, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, num_layers=info.num_layers, hidden_size=info.hidden_size,
            dtype=info.dtype, page_size=info.page_size,
            max_num_batched_tokens=info.max_num_batched_tokens,
            pipeline_parallel_size=info.pipeline_parallel_size,
            tensor_parallel_size=info.tensor_parallel_size,
            eos_token_ids=list(info.eos_token_ids), server_version=jaxcpp.__version__)

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetServerStatsResponse:
        try:
            s = await asyncio.wrap_future(self._engine.submit(self._engine.engine.stats))
        except EngineFailedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        values, labels = split_dynamic_chunking(s.dynamic_chunking)
        return pb.GetServerStatsResponse(
            num_running=s.num_running, num_waiting=s.num_waiting, num_pages_used=s.num_pages_used,
            num_pages_free=s.num_pages_free, num_pages_total=s.num_pages_total,
            num_compilations_since_warmup=s.num_compilations_since_warmup,
            num_prompt_tokens_total=s.num_prompt_tokens_total,
            num_generation_tokens_total=s.num_generation_tokens_total,
            num_preemptions_total=s.num_preemptions_total, num_in_flight=len(self._in_flight),
            max_queue_size=self._config.max_queue_size,
            dynamic_chunking=pb.DynamicChunkingStats(values=values, labels=labels),
            uptime_s=time.monotonic() - self._started)

    def _response(self, request_id: str, out: RequestOutput, text: str) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=text)
        if out.finished:
            m = out.metrics
            response.finish_reason = _FINISH_REASONS.get(out.finish_reason or "",
                                                         pb.FINISH_REASON_UNSPECIFIED)
            response.num_prompt_tokens = len(out.prompt_token_ids)
            response.num_generated_tokens = len(out.token_ids)
            response.ttft_s = m.ttft or 0.0
            response.e2e_s = m.e2e or 0.0
        return response

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self._metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    def _enter(self, request_id: str) -> None:
        self._in_flight.add(request_id)
        self._metrics.set_in_flight(len(self._in_flight))

    def _leave(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        self._metrics.set_in_flight(len(self._in_flight))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <key>` is sent; health stays open for probes."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        return _deny_handler(handler)


class _WarmUpGate(grpc.aio.ServerInterceptor):
    """UNAVAILABLE "warming up" for the service's RPCs until `open()`; health and reflection always answer."""

    def __init__(self) -> None:
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if self.is_open or handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        return _abort_handler(handler, grpc.StatusCode.UNAVAILABLE,
                              "warming up: the engine is loading the model and compiling; retry when "
                              "health is SERVING")


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong API key: send metadata 'authorization: Bearer <key>'")


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                   message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails every call with `code`."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield None  # pragma: no cover - abort raises

    serdes = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **serdes)
    return grpc.unary_unary_rpc_method_handler(deny, **serdes)


class Server:
    """One gRPC server around one engine. Create and use it inside a running asyncio loop.

    Given an engine, `start()` serves it at once. Given None, `start()` serves health (NOT_SERVING)
    and "warming up" answers until `build_engine(factory)` or `attach_engine(engine)` is awaited.
    """

    drain_announce_s = 1.0  # see stop(); a Watch-ing client gets NOT_SERVING pushed within milliseconds

    def __init__(self, engine: Engine | None, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServingMetrics()
        self.health = health.aio.HealthServicer()
        self.servicer = JaxcppServicer(config, self.metrics)
        self.engine_loop: EngineLoop | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._engine = engine
        self._gate = _WarmUpGate()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self.failure: BaseException | None = None   # the engine's (or its executor's) fatal error
        self._failed: asyncio.Event | None = None

    async def start(self) -> int:
        """Start the server (and the engine thread, if given an engine); returns the bound port."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        interceptors: list[grpc.aio.ServerInterceptor] = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
        interceptors.append(self._gate)
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # never share a port with a stale server
        server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_JaxcppServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert and cfg.tls_key:
            pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
            creds = grpc.ssl_server_credentials([pair])
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # HealthServicer starts SERVING
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.host, cfg.metrics_port)
        if self._engine is not None:
            await self.attach_engine(self._engine)
        return self.port

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
        """Start the engine thread on `engine`, open the service and turn health SERVING."""
        self.engine_loop = EngineLoop(engine, self.metrics, on_failure=self._on_engine_failure)
        listen = getattr(getattr(engine, "executor", None), "add_failure_listener", None)
        if listen is not None:  # a stage process that dies while the engine idles is noticed too
            listen(self._on_engine_failure)
        self.engine_loop.start()
        model_info = await asyncio.wrap_future(self.engine_loop.submit(engine.model_info))
        self.servicer.attach(self.engine_loop, model_info)
        self._gate.open()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float | None = None) -> None:
        """Turn health NOT_SERVING; then refuse new calls, let calls in flight finish within `grace`
        seconds, abort the rest, stop.

        For the first `drain_announce_s` of the grace the server still listens and health answers
        NOT_SERVING (a probe, or a client watching health, sees the drain and moves on); then the listener
        closes (GOAWAY: connected clients reconnect elsewhere) and the calls in flight get the rest.
        """
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            announce = min(self.drain_announce_s, grace)
            await asyncio.sleep(announce)
            await self._server.stop(grace - announce)
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop, 30.0)
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_engine_failure(self, exc: BaseException) -> None:  # engine thread (or an executor's)
        self.failure = self.failure or exc
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self._loop)
            if self._failed is not None:
                self._loop.call_soon_threadsafe(self._failed.set)

    async def wait_for_failure(self) -> None:
        assert self._failed is not None, "start() first"
        await self._failed.wait()


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

    Returns the exit code: 0, also for a signal during warm-up (nothing to drain then); 1 when the
    engine failed while serving (e.g. a pipeline stage process died). An engine that fails to build
    stops the server and raises.
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
    failed = asyncio.ensure_future(server.wait_for_failure())
    await asyncio.wait((stopping, failed), return_when=asyncio.FIRST_COMPLETED)
    if failed.done() and not stopping.done():  # exit non-zero so that an orchestrator restarts the group
        log.error("engine failed: %s; stopping (exit 1)", server.failure)
        stopping.cancel()
        await server.stop(0)
        return 1
    failed.cancel()
    log.info("shutting down: %d requests in flight, %.1f s grace", server.servicer.num_in_flight,
             config.shutdown_grace_s)
    await server.stop()
    return 0
