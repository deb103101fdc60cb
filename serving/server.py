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

Backpressure: a client that stops reading fills gRPC's flow-control window, the handler's write
blocks and the stream's outputs pile up in its queue. Past `--max-stream-buffer` queued outputs the
request is aborted in the engine (its pages freed), its queue slot released, and the call ended with
RESOURCE_EXHAUSTED from a separate task (the handler itself is stuck in the blocked write).

Requests that are not a valid protobuf message get INVALID_ARGUMENT (not gRPC's UNKNOWN): every
unary request deserializer is wrapped to hand the handler an `_Undecodable` marker instead of raising.

Shutdown (`Server.stop`): health goes NOT_SERVING (and answers so for the first second), then new calls
are refused (UNAVAILABLE), calls in flight get the rest of `--shutdown-grace-s` to finish; the requests
still running then are aborted in the engine, so their streams end normally with finish reason ABORT;
then the engine thread stops.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
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
from jaxcpp.core.executor import ExecutorError
from jaxcpp.core.outputs import ModelInfo, RequestOutput, TokenLogprobs
from jaxcpp.errors import InvalidRequestError
from jaxcpp.output_processor import RequestState, SampleDelta, needs_abort
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.chat_template import ChatTemplate, load_chat_template
from jaxcpp.serving.disaggregation import connect_producers, kv_transfer_from_proto, layout_to_proto, offer_to_proto
from jaxcpp.serving.engine_loop import Engine, EngineFailedError, EngineLoop, OutputStream
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.metrics import ServingMetrics, split_dynamic_chunking
from jaxcpp.serving.openai_server import OpenAIServer
from jaxcpp.structured.constraint import StructuredOutputs

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxcppService"].full_name
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
MAX_REQUEST_ID_CHARS = 256  # echoed in every response message, so it is kept short
_ABORT_FLUSH_S = 5.0        # after the grace period: time for the ABORT messages to reach clients


_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "min_p", "min_tokens",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                             "prompt_logprobs")


def sampling_params_from_proto(msg: pb.SamplingParameters) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; raises InvalidRequestError naming the field."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, stop=tuple(msg.stop),
                          include_stop_str_in_output=msg.include_stop_str_in_output, **kwargs)


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The proto's one kind of constraint; raises InvalidRequestError naming the field."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", "set one of json, json_object, regex, choice, grammar")
    if kind == "json":
        return StructuredOutputs.from_schema(msg.json)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.values))
    return StructuredOutputs(**{kind: getattr(msg, kind)})


def prompt_from_proto(request: pb.GenerateRequest, max_prompt_bytes: int) -> str | list[int]:
    """The prompt, refused before tokenizing when its text is over `max_prompt_bytes` (UTF-8)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        text = request.text
        # len(text) <= UTF-8 size <= 4 * len(text): the first test avoids encoding a huge prompt
        if len(text) > max_prompt_bytes or len(text.encode("utf-8", "surrogatepass")) > max_prompt_bytes:
            raise InvalidRequestError("text", f"prompt text is over --max-prompt-bytes {max_prompt_bytes} "
                                      "(UTF-8 bytes)")
    if kind is None:  # an empty one is the engine's to refuse (`check_request`), as for every front end
        raise InvalidRequestError("prompt", "must be set: `text` or `token_ids`")
    return request.text if kind == "text" else list(request.token_ids.ids)


def request_id_from_proto(request: pb.GenerateRequest) -> str:
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, "
                                  f"got {len(request.request_id)}")
    return request.request_id or uuid.uuid4().hex


class _Undecodable:
    """What a wrapped deserializer returns for bytes that are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _undecodable_message(request: _Undecodable) -> str:
    return f"request: not a valid protobuf message of the method's request type ({request.error})"


class JaxcppServicer(pb_grpc.JaxcppServiceServicer):
    """Registered before the engine exists; `attach` hands it the engine (`_WarmUpGate` holds calls until then)."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics) -> None:
        self._engine: EngineLoop  # set by attach()
        self._model_info: ModelInfo
        self._config = config
        self._metrics = metrics
        self._in_flight: dict[str, OutputStream] = {}  # touched on the asyncio loop only
        self._started = time.monotonic()
        self._closing = False
        self.max_stream_backlog = 0  # high-water mark of any stream's queued outputs (tests, soak)
        self.others_in_flight: Callable[[], int] = lambda: 0  # the HTTP API's calls: one queue limit for both

    def attach(self, engine_loop: EngineLoop, model_info: ModelInfo) -> None:
        self._engine = engine_loop
        self._model_info = model_info

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if (unready := self._engine.unready_reason()) is not None:  # a kv_consumer without a ready producer
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, unready)
        try:
            params = sampling_params_from_proto(request.sampling)
            prompt = prompt_from_proto(request, self._config.max_prompt_bytes)
            request_id = request_id_from_proto(request)
        except InvalidRequestError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        kv_transfer = None
        if request.HasField("kv_transfer"):  # a consumer's prefill (disaggregation)
            kv_transfer, refused = kv_transfer_from_proto(request.kv_transfer, self._model_info, context.peer())
            if refused is not None:
                await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, refused)
        if (held := len(self._in_flight) + self.others_in_flight()) >= self._config.max_queue_size:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request queue is full: {held} requests in flight "
                               f"(--max-queue-size {self._config.max_queue_size}); retry later")
        if request_id in self._in_flight:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: {request_id!r} is already in flight")
        stream = OutputStream(request_id, self._config.max_stream_buffer, self._on_stalled, context)
        self._enter(stream)
        state = RequestState(request_id, params, self._engine.engine.tokenizer)
        stream.engine_request_ids = [rid for rid, _ in state.engine_requests]
        try:
            await asyncio.wrap_future(self._engine.add_samples(state, prompt, stream.sink(), kv_transfer))
            while not state.finished:
                out = await stream.outputs.get()
                if isinstance(out, BaseException):
                    # a lost pipeline stage is the server's loss, not the request's: retry elsewhere
                    lost = isinstance(out, ExecutorError)
                    await context.abort(grpc.StatusCode.UNAVAILABLE if lost else grpc.StatusCode.INTERNAL,
                                        f"engine failed: {out}" if lost else f"engine failed: {out!r}")
                    return
                if out.finish_reason == "error":  # the engine failed this request and carries on
                    code = grpc.StatusCode.UNAVAILABLE if out.unavailable else grpc.StatusCode.INTERNAL
                    await context.abort(code, f"engine failed this request: {out.error}")
                delta = state.process(out)
                if needs_abort(out, delta):  # a stop string ended it
                    self._engine.abort(out.request_id, "stop")
                if delta is not None:
                    yield self._response(request_id, out, delta)
        except InvalidRequestError as exc:  # the engine refused it
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineFailedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not stream.stalled:  # cancelled, disconnected, deadline, grace over: a no-op when finished
                stream.abort(self._engine)
            self._leave(stream)

    def _on_stalled(self, stream: OutputStream) -> None:
        """A client stopped reading: free its pages and its queue slot now, end the call from aside."""
        log.warning("request %r: client is not reading (%d responses queued); aborting", stream.request_id,
                    stream.outputs.qsize())
        stream.abort(self._engine)
        self._leave(stream)
        self._metrics.rejected.labels(grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
        message = (f"client is not reading: {stream.outputs.qsize()} responses queued "
                   f"(--max-stream-buffer {self._config.max_stream_buffer} per sample); request aborted")
        stream.end_task = asyncio.ensure_future(_abort_call(stream, message))

    def close(self) -> None:
        """Refuse new Generate calls (shutdown)."""
        self._closing = True

    def request_ids_in_flight(self) -> list[str]:
        return list(self._in_flight)

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
            eos_token_ids=list(info.eos_token_ids), server_version=jaxcpp.__version__,
            kv_cache_dtype=info.kv_cache_dtype, kv_role=info.kv_role,
            kv_layout=layout_to_proto(info.kv_layout) if info.kv_layout is not None else None)

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetServerStatsResponse:
        try:
            s = await asyncio.wrap_future(self._engine.submit(self._engine.engine.stats))
        except EngineFailedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        values, labels = split_dynamic_chunking(s.dynamic_chunking)
        return pb.GetServerStatsResponse(
            **s.counts(), num_in_flight=len(self._in_flight) + self.others_in_flight(),
            max_queue_size=self._config.max_queue_size,
            dynamic_chunking=pb.DynamicChunkingStats(values=values, labels=labels),
            uptime_s=time.monotonic() - self._started)

    def _response(self, request_id: str, out: RequestOutput, delta: SampleDelta) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                                       index=delta.index, logprobs=_logprobs_proto(delta.logprobs))
        if out.prompt_logprobs is not None and len(delta.token_ids) == out.num_generated:  # its first message
            response.prompt_logprobs.extend(_logprobs_proto(out.prompt_logprobs))
        if delta.finished:
            m = out.metrics
            response.finish_reason = _FINISH_REASONS.get(delta.finish_reason or "",
                                                         pb.FINISH_REASON_UNSPECIFIED)
            response.num_prompt_tokens = len(out.prompt_token_ids)
            response.num_generated_tokens = out.num_generated
            response.ttft_s = m.ttft or 0.0
            response.e2e_s = m.e2e or (time.monotonic() - m.arrival_time)
            response.num_cached_tokens = out.num_cached_tokens
            response.stop_string = delta.stop_reason if isinstance(delta.stop_reason, str) else ""
            if out.kv_offer is not None:
                response.kv_offer.CopyFrom(offer_to_proto(out.kv_offer))
        return response

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self._metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    def _enter(self, stream: OutputStream) -> None:
        self._in_flight[stream.request_id] = stream
        self._metrics.set_in_flight(len(self._in_flight) + self.others_in_flight())

    def _leave(self, stream: OutputStream) -> None:
        self.max_stream_backlog = max(self.max_stream_backlog, stream.max_backlog)
        key = stream.request_id
        if self._in_flight.get(key) is stream:
            del self._in_flight[key]
        self._metrics.set_in_flight(len(self._in_flight) + self.others_in_flight())


async def _abort_call(stream: OutputStream, message: str) -> None:
    """End a call whose handler is blocked in a write. The handler is cancelled first (were the status
    sent first, its pending write would fail and gRPC would log that as an error), then the status goes
    out behind what the transport still buffers."""
    task = stream.handler_task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
    try:
        await stream.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    except BaseException:  # noqa: B036 - abort always raises AbortError; the call is over either way
        pass


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


class RejectUndecodableInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for request bytes that do not parse (gRPC alone answers UNKNOWN).

    Wraps each unary-request handler: its deserializer returns an `_Undecodable` marker instead of
    raising, and its behaviour answers the marker with INVALID_ARGUMENT before the servicer sees it.
    Streaming-request methods (reflection) keep gRPC's own handling."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _tolerant_handler(handler)


def _tolerant_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, and others on odd input
            return _Undecodable(exc)

    serdes = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
            responses = inner_stream(request, context)
            if inspect.isawaitable(responses):  # a coroutine that writes with context.write (Health.Watch)
                await responses
                return
            if not inspect.isasyncgen(responses):  # a plain generator: sync servicers are allowed
                for response in responses:
                    yield response
                return
            try:
                async for response in responses:
                    yield response
            finally:  # a cancelled call closes this generator; close the servicer's with it
                await responses.aclose()

        return grpc.unary_stream_rpc_method_handler(stream, **serdes)
    inner_unary = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        response = inner_unary(request, context)
        return await response if inspect.isawaitable(response) else response

    return grpc.unary_unary_rpc_method_handler(unary, **serdes)


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
        self.http = OpenAIServer(config, self.metrics, lambda: self.servicer.num_in_flight) \
            if config.enable_http else None
        if self.http is not None:
            self.servicer.others_in_flight = lambda: self.http.num_in_flight if self.http is not None else 0
        self.engine_loop: EngineLoop | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._engine = engine
        self._gate = _WarmUpGate()
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
        return self.servicer.num_in_flight + (self.http.num_in_flight if self.http is not None else 0)

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
        cfg = self.config
        api_key = cfg.resolve_api_key()
        interceptors: list[grpc.aio.ServerInterceptor] = [ApiKeyInterceptor(api_key)] if api_key else []
        interceptors += [RejectUndecodableInterceptor(), self._gate]
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # never share a port with a stale server
        server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_JaxcppServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.enable_reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME), server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert and cfg.tls_key:
            self.port = server.add_secure_port(address, _server_credentials(cfg))
        else:
            self.port = server.add_insecure_port(address)
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
        remote = connect_producers(engine, self.config.resolve_api_key())  # a kv_consumer's: before requests
        self.engine_loop = EngineLoop(engine, self.metrics, on_failure=self._on_engine_failure)
        engine.add_failure_listener(self._on_engine_failure)  # a stage that dies while the engine idles
        self.engine_loop.start()
        model_info = await asyncio.wrap_future(self.engine_loop.submit(engine.model_info))
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


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials:
    """TLS with the server's chain and key; with --tls-client-ca, clients must present a certificate
    that CA signed (mutual TLS)."""
    assert cfg.tls_cert and cfg.tls_key
    pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
    if cfg.tls_client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=Path(cfg.tls_client_ca).read_bytes(),
                                       require_client_auth=True)


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


def _logprobs_proto(entries: list[TokenLogprobs] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top]) for e in entries or ()]
