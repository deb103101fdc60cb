"""The gRPC port's edge: what answers a call before the servicer sees it, and the gRPC server itself.

    ApiKeyInterceptor             UNAUTHENTICATED without `authorization: Bearer <key>` (the key check is
                                  `serving/security.py`'s, the HTTP port's too); health stays open for probes
    RejectUndecodableInterceptor  INVALID_ARGUMENT for request bytes that are not a valid protobuf message
                                  (gRPC alone answers UNKNOWN)
    WarmUpGate                    UNAVAILABLE "warming up" for the service's RPCs until the engine is attached
    grpc_server(...)              the grpc.aio server with these, the servicer, health and reflection, on
                                  `--host`/`--port`, with TLS when configured

`serving/http_edge.py` is the HTTP port's counterpart.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxcpp.config import ServerConfig
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.security import bearer_matches, grpc_credentials
from jaxcpp.serving.server import SERVICE_NAME, JaxcppServicer

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def grpc_server(cfg: ServerConfig, servicer: JaxcppServicer, health_servicer: health.aio.HealthServicer,
                gate: WarmUpGate, api_key: str | None) -> tuple[grpc.aio.Server, int]:
    """The gRPC server (not started) and its bound port; `api_key`: the key calls must send (None: none)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [ApiKeyInterceptor(api_key)] if api_key else []
    interceptors += [RejectUndecodableInterceptor(), gate]
    options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
               ("grpc.max_send_message_length", cfg.max_message_bytes),
               ("grpc.so_reuseport", 0)]  # never share a port with a stale server
    server = grpc.aio.server(interceptors=interceptors, options=options)
    pb_grpc.add_JaxcppServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.enable_reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
    address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
    credentials = grpc_credentials(cfg)
    port = server.add_secure_port(address, credentials) if credentials is not None else \
        server.add_insecure_port(address)
    return server, port


class _Undecodable:
    """What a wrapped deserializer returns for bytes that are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _undecodable_message(request: _Undecodable) -> str:
    return f"request: not a valid protobuf message of the method's request type ({request.error})"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <key>` is sent; health stays open for probes."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        if bearer_matches(dict(details.invocation_metadata or ()).get("authorization", ""), self._key):
            return handler
        return _deny_handler(handler)


class WarmUpGate(grpc.aio.ServerInterceptor):
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
