"""Python client stubs for `jaxcpp.v1.JaxcppService`: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051") as c:
        c.wait_ready(timeout=120)          # connected and SERVING: a starting server compiles first
        print(c.generate("Once upon a time", max_tokens=32, temperature=0).text)
        for delta in c.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")

A prompt is text or a list of token ids. Sampling keywords left as None take the server's defaults
(those of `jaxcpp.SamplingParams`). Every call raises `ClientError` (exported as
`jaxcpp.serving.ClientError`) when it fails: `.status` is the gRPC status code, `.field` the request
field the server's message names (or None), `.message` the server's words. It subclasses
`grpc.RpcError` and keeps its `code()`/`details()`, so older `except grpc.RpcError` code still works.
Leaving a `stream()` loop early cancels the call, and the server aborts the request and frees its pages.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxcpp.core.outputs import EngineStats, ModelInfo
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# The server's refusals read "field: what is wrong" (jaxcpp.errors.InvalidRequestError).
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")
_T = TypeVar("_T")
_POLL_S = 0.1  # wait_ready: how often health is asked while the server warms up
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_ABORT: "abort"}


class ClientError(grpc.RpcError):
    """A failed call: the gRPC status, the request field the server's message names (if any), its message.

        try:
            client.generate(prompt, top_p=2)
        except ClientError as err:
            err.status   # grpc.StatusCode.INVALID_ARGUMENT
            err.field    # "top_p"
            err.message  # "top_p: must be in (0, 1], got 2.0"
    """

    def __init__(self, status: grpc.StatusCode, message: str, target: str = "") -> None:
        super().__init__(f"{status.name}: {message}" + (f" (server {target})" if target else ""))
        self.status = status
        self.message = message
        self.target = target
        match = _FIELD_PREFIX.match(message)
        self.field: str | None = match.group(1) if match else None

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, target: str = "") -> ClientError:
        code = err.code() if callable(getattr(err, "code", None)) else None
        details = err.details() if callable(getattr(err, "details", None)) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(err), target)

    # grpc.RpcError's call interface, for callers written against it.
    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message


def _call(target: str, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except ClientError:
        raise
    except grpc.RpcError as err:
        raise ClientError.from_rpc(err, target) from err


async def _acall(target: str, awaitable: Awaitable[_T]) -> _T:
    try:
        return await awaitable
    except ClientError:
        raise
    except grpc.RpcError as err:
        raise ClientError.from_rpc(err, target) from err


@dataclass(frozen=True)
class Delta:
    """One streamed message: the tokens and text since the previous one. The last has finish_reason."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length", "abort" on the last delta; None before
    num_prompt_tokens: int = 0         # last delta only
    num_generated_tokens: int = 0      # last delta only
    ttft_s: float = 0.0                # last delta only: the engine's time to first token
    e2e_s: float = 0.0                 # last delta only: admission to last token
    num_cached_tokens: int = 0         # last delta only: prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    ttft_s: float
    e2e_s: float
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class ServerStats:
    engine: EngineStats
    num_in_flight: int                 # Generate calls the server holds now
    max_queue_size: int
    uptime_s: float
    dynamic_chunking_labels: dict[str, str] = field(default_factory=dict)


def build_request(prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int | None = None,
                  temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  structured_outputs: pb.StructuredOutputs | None = None) -> pb.GenerateRequest:
    """`structured_outputs`: e.g. pb.StructuredOutputs(json=json.dumps(schema)) or (regex=...)."""
    sampling = pb.SamplingParameters(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                     structured_outputs=structured_outputs)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def delta_from_proto(msg: pb.GenerateResponse) -> Delta:
    return Delta(request_id=msg.request_id, text=msg.text, token_ids=list(msg.token_ids),
                 finish_reason=_FINISH_REASONS.get(msg.finish_reason),
                 num_prompt_tokens=msg.num_prompt_tokens, num_generated_tokens=msg.num_generated_tokens,
                 ttft_s=msg.ttft_s, e2e_s=msg.e2e_s, num_cached_tokens=msg.num_cached_tokens)


def _join(deltas: list[Delta]) -> Completion:
    last = deltas[-1]
    return Completion(request_id=last.request_id, text="".join(d.text for d in deltas),
                      token_ids=[t for d in deltas for t in d.token_ids], finish_reason=last.finish_reason,
                      num_prompt_tokens=last.num_prompt_tokens,
                      num_generated_tokens=last.num_generated_tokens,
                      ttft_s=last.ttft_s, e2e_s=last.e2e_s, num_cached_tokens=last.num_cached_tokens)


def _model_info(msg: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(name=msg.name, architecture=msg.architecture, vocab_size=msg.vocab_size,
                     max_model_len=msg.max_model_len, num_layers=msg.num_layers, hidden_size=msg.hidden_size,
                     dtype=msg.dtype, page_size=msg.page_size,
                     max_num_batched_tokens=msg.max_num_batched_tokens,
                     pipeline_parallel_size=msg.pipeline_parallel_size,
                     tensor_parallel_size=msg.tensor_parallel_size, eos_token_ids=tuple(msg.eos_token_ids),
                     kv_cache_dtype=msg.kv_cache_dtype)


def _server_stats(msg: pb.GetServerStatsResponse) -> ServerStats:
    engine = EngineStats.from_counts(msg, dict(msg.dynamic_chunking.values))
    return ServerStats(engine=engine, num_in_flight=msg.num_in_flight, max_queue_size=msg.max_queue_size,
                       uptime_s=msg.uptime_s, dynamic_chunking_labels=dict(msg.dynamic_chunking.labels))


def _unreachable(target: str, timeout: float) -> ClientError:
    return ClientError(grpc.StatusCode.UNAVAILABLE, f"no jaxcpp server reachable at {target} within {timeout:g}s")


def _not_ready(target: str, timeout: float, status: str) -> ClientError:
    return ClientError(grpc.StatusCode.UNAVAILABLE, f"the jaxcpp server at {target} is not ready within "
                       f"{timeout:g}s: its health is {status} (still warming up, or shutting down)")


class _ClientBase:
    """Channel, metadata and stubs shared by both clients; `_grpc` opens the channel (grpc or grpc.aio)."""

    _grpc: Any

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, server_name: str | None = None,
                 max_message_bytes: int = 4 * 1024 * 1024, timeout: float | None = None) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._timeout = timeout
        self.target = target
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes),
                                          ("grpc.max_send_message_length", max_message_bytes)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls or root_certificates is not None:
            roots = Path(root_certificates).read_bytes() if isinstance(root_certificates, str | Path) \
                else root_certificates
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self.channel = self._grpc.secure_channel(target, credentials, options)
        else:
            self.channel = self._grpc.insecure_channel(target, options)
        self._stub = pb_grpc.JaxcppServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)


class Client(_ClientBase):
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None: no deadline."""

    _grpc = grpc

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the server is ready for requests: connected, and its health SERVING (a server
        answers NOT_SERVING while it warms up). ClientError (UNAVAILABLE) naming the target if not in time."""
        deadline = time.monotonic() + timeout
        self.wait_connected(timeout)
        while (status := self.health(timeout=max(_POLL_S, deadline - time.monotonic()))) != "SERVING":
            if time.monotonic() + _POLL_S > deadline:
                raise _not_ready(self.target, timeout, status)
            time.sleep(_POLL_S)

    def wait_connected(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected (the server may still be warming up); ClientError
        (UNAVAILABLE, naming the target) if not in time."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise _unreachable(self.target, timeout) from None

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
               **sampling: Any) -> Iterator[Delta]:
        """Yield deltas as tokens arrive. Keywords: request_id and build_request's sampling fields."""
        call = self._stub.Generate(build_request(prompt, **sampling), timeout=timeout or self._timeout,
                                   metadata=self._metadata)
        try:
            while (msg := _call(self.target, lambda: next(call, None))) is not None:
                yield delta_from_proto(msg)
        finally:
            call.cancel()  # no-op once finished; aborts the request if the caller stopped early

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **sampling: Any) -> Completion:
        return _join(list(self.stream(prompt, timeout=timeout, **sampling)))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The standard health check: "SERVING", "NOT_SERVING", ..."""
        response = _call(self.target, lambda: self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=timeout or self._timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(_call(self.target, lambda: self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout or self._timeout, metadata=self._metadata)))

    def stats(self, timeout: float | None = None) -> ServerStats:
        return _server_stats(_call(self.target, lambda: self._stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=timeout or self._timeout, metadata=self._metadata)))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """asyncio client with the same methods as `Client` (awaitables; `stream` is an async iterator)."""

    _grpc = grpc.aio

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the server is ready for requests: connected, and its health SERVING; ClientError
        (UNAVAILABLE, naming the target) if not in time."""
        deadline = time.monotonic() + timeout
        await self.wait_connected(timeout)
        while (status := await self.health(timeout=max(_POLL_S, deadline - time.monotonic()))) != "SERVING":
            if time.monotonic() + _POLL_S > deadline:
                raise _not_ready(self.target, timeout, status)
            await asyncio.sleep(_POLL_S)

    async def wait_connected(self, timeout: float = 10.0) -> None:
        """Wait until the channel is connected; ClientError (UNAVAILABLE, naming the target) if not in time."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError:
            raise _unreachable(self.target, timeout) from None

    async def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                     **sampling: Any) -> AsyncIterator[Delta]:
        call = self._stub.Generate(build_request(prompt, **sampling), timeout=timeout or self._timeout,
                                   metadata=self._metadata)
        try:
            messages = call.__aiter__()
            while True:
                try:
                    msg = await _acall(self.target, messages.__anext__())
                except StopAsyncIteration:
                    return
                yield delta_from_proto(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **sampling: Any) -> Completion:
        return _join([d async for d in self.stream(prompt, timeout=timeout, **sampling)])

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        response = await _acall(self.target, self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=timeout or self._timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(await _acall(self.target, self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout or self._timeout, metadata=self._metadata)))

    async def stats(self, timeout: float | None = None) -> ServerStats:
        return _server_stats(await _acall(self.target, self._stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=timeout or self._timeout, metadata=self._metadata)))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
