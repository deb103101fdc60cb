"""The gRPC server: `jaxcpp.v1.JaxcppService`, standard health and reflection, on grpc.aio.

How a Generate call moves: the handler (on the asyncio loop) validates the request, takes a slot in
the bounded queue (`--max-queue-size` calls in flight, RESOURCE_EXHAUSTED beyond), and hands the
request to the `EngineLoop` thread with a sink that posts each `RequestOutput` back onto the asyncio
loop; the handler detokenizes and streams each output as it arrives. Whatever ends the call early
(client cancel, disconnect, deadline, shutdown) cancels the handler, whose `finally` sends an abort,
which the engine thread runs before its next step. No thread per stream: one asyncio loop, one engine
thread, and prometheus-client's HTTP thread.

Shutdown (`Server.stop`): health goes NOT_SERVING, new calls are refused, calls in flight get
`--shutdown-grace-s` to finish, then are cancelled (and so aborted); then the engine thread stops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import jaxcpp
from jaxcpp.config import ServerConfig
from jaxcpp.errors import InvalidRequestError
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
    def __init__(self, engine_loop: EngineLoop, config: ServerConfig, metrics: ServingMetrics,
                 model_info: ModelInfo) -> None:
        self._engine = engine_loop
        self._config = config
        self._metrics = metrics
        self._model_info = model_info
        self._in_flight: set[str] = set()  # touched on the asyncio loop only
        self._started = time.monotonic()

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
                    await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {out!r}")
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


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield None  # pragma: no cover - abort raises

    serdes = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **serdes)
    return grpc.unary_unary_rpc_method_handler(deny, **serdes)


class Server:
    """One gRPC server around one engine. Create and use it inside a running asyncio loop."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServingMetrics()
        self.health = health.aio.HealthServicer()
        self.engine_loop = EngineLoop(engine, self.metrics, on_failure=self._on_engine_failure)
        self.port = 0
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Start the engine thread and the server; returns the bound port."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self.engine_loop.start()
        interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # never share a port with a stale server
        server = grpc.aio.server(interceptors=interceptors, options=options)
        model_info = await asyncio.wrap_future(self.engine_loop.submit(self.engine_loop.engine.model_info))
        self.servicer = JaxcppServicer(self.engine_loop, cfg, self.metrics, model_info)
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
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.host, cfg.metrics_port)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let calls in flight finish for `grace` seconds, abort the rest, stop."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        await asyncio.to_thread(self.engine_loop.stop, 30.0)
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_engine_failure(self, exc: BaseException) -> None:  # engine thread
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self._loop)


class ServerThread:
    """A `Server` on its own asyncio loop in a background thread: for tests and embedding.

        with ServerThread(engine, ServerConfig(port=0)) as server:
            Client(f"127.0.0.1:{server.port}")
    """

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
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

    def stop(self, grace: float | None = 0.0) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(timeout=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(engine: Engine, config: ServerConfig,
                on_ready: Callable[[Server], None] | None = None) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully; returns the exit code (0)."""
    import signal

    server = Server(engine, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    log.info("shutting down: %d requests in flight, %.1f s grace", server.servicer.num_in_flight,
             config.shutdown_grace_s)
    await server.stop()
    return 0
