"""The HTTP port's edge: what is refused before a request reaches FastAPI, cheapest check first.

In this order, for every connection and request:

  1. the request's head (request line and headers): at most `max_header_bytes` bytes, else 431 and the
     connection closed, counted as the bytes arrive (nothing past the cap is buffered); at most
     `MAX_HEADERS` header lines, else 431; all of it within `read_timeout_s` of the connection opening
     (or of the previous response), else the connection is closed (slow or idle clients: slowloris);
  2. the API key (`Authorization: Bearer <key>`, the scheme in any case) on every path but the open ones
     (/health, /version, /metrics, /docs, /openapi.json): 401 before a byte of the body is read;
  3. `Content-Length` over `--max-message-bytes` (or not a number): 413 (400) before reading the body;
  4. the body, read here whole: past `--max-message-bytes` (a chunked body has no Content-Length) 413,
     and not done within `read_timeout_s`: 408. Both close the connection.

Then FastAPI parses the JSON (a body that is not JSON is a 400 error object, `openai_server`) and the
route validates the fields. The head is counted in uvicorn's own protocol (`EdgeProtocol`, a subclass
of its httptools one: uvicorn has no header size, count or header timeout for it); the rest is a
plain ASGI middleware (`EdgeMiddleware`). Every answer here is an OpenAI error object. `listen` binds
the port and serves an app behind both; `sse` frames a stream as server-sent events, and
`until_disconnected` cancels a blocking call's work when its client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jaxcpp.config import ServerConfig
from jaxcpp.serving.openai_protocol import OpenAIError
from jaxcpp.serving.security import bearer_matches, uvicorn_tls

MAX_HEADERS = 128  # header lines in one request (nginx and h11 allow about 100)
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/docs", "/openapi.json"})
HEAD_TOO_LARGE = "jaxcpp.head_too_large"  # set in the request's scope by `EdgeProtocol`: why

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def listen(app: Callable[[Scope, Receive, Send], Awaitable[None]], cfg: ServerConfig,
                 api_key: str | None) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """Serve `app` behind this edge on `--host`/`--http-port` (TLS when configured), on the running loop;
    returns the uvicorn server, its task and the bound port once it listens."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP. Without it a
    # stream's first chunk waits behind its headers for the client's delayed ACK (Nagle: ~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.http_port))
    sock.listen(2048)
    sock.setblocking(False)
    limits = EdgeLimits(cfg.max_message_bytes, cfg.max_header_bytes, cfg.http_read_timeout_s, api_key)
    server_config = uvicorn.Config(EdgeMiddleware(app, limits), log_level="warning", lifespan="off",
                                   access_log=False, timeout_graceful_shutdown=1,
                                   http=edge_protocol(limits), **uvicorn_tls(cfg))
    server = _Uvicorn(server_config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.005)
    if task.done():
        task.result()  # raises what stopped it
    return server, task, int(sock.getsockname()[1])


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM belongs to `jaxcpp.serving.lifecycle.serve`, which drains
    both front ends."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int
    max_header_bytes: int
    read_timeout_s: float
    api_key: str | None


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class uvicorn builds per connection (`uvicorn.Config(http=...)` takes a class)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a cap on a request head's bytes and lines and a deadline for it."""

    limits: EdgeLimits  # set by `edge_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = self.limits
        self._head_bytes = 0    # bytes of a head not yet ended (all reads so far)
        self._parsed_bytes = 0  # its request line and headers as parsed
        self._in_head = True  # waiting for (the rest of) a request's head
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_head = self._in_head
        super().data_received(data)
        if in_head and self._in_head:  # this data ended no head: all of it is head
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_header_bytes and not self.transport.is_closing():
                self._refuse(OpenAIError(431, f"request headers over {self._limits.max_header_bytes} bytes"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """A head that arrived whole in one read is counted here (`data_received` counts one that has not
        ended yet): past the caps, the header is dropped and the middleware answers 431."""
        self._parsed_bytes += len(name) + len(value) + 4
        if self._parsed_bytes > self._limits.max_header_bytes:
            self.scope[HEAD_TOO_LARGE] = f"request headers over {self._limits.max_header_bytes} bytes"  # type: ignore[literal-required]
        elif len(self.headers) >= MAX_HEADERS:
            self.scope[HEAD_TOO_LARGE] = f"more than {MAX_HEADERS} request headers"  # type: ignore[literal-required]
        else:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._wait_for_head()  # a kept-alive connection: the next request's head has the same deadline

    def _wait_for_head(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self._limits.read_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        if self._in_head and not self.transport.is_closing():
            self._refuse(OpenAIError(408, f"request headers not received within {self._limits.read_timeout_s:g}s"))

    def _refuse(self, error: OpenAIError) -> None:
        body = json.dumps(error.body()).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (error.status, _REASONS[error.status], len(body), body))
        self.transport.close()


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class EdgeMiddleware:
    """Steps 2-4 of the module docstring, before the app sees the request."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limits: EdgeLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope)
            body = await self._read_body(scope, receive) if scope["method"] in ("POST", "PUT", "PATCH") else None
        except OpenAIError as error:
            await send_error(send, error, close=error.status in (408, 413, 431))
            return
        await self.app(scope, _replay(body, receive) if body is not None else receive, send)

    def _check_head(self, scope: Scope) -> None:
        if HEAD_TOO_LARGE in scope:
            raise OpenAIError(431, scope[HEAD_TOO_LARGE])
        headers = dict(scope["headers"])  # the last of repeated names, as Starlette's lookups do not
        key = self.limits.api_key
        if key is not None and scope["path"] not in OPEN_PATHS and not _authorized(headers, key):
            raise OpenAIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        size = headers.get(b"content-length")
        if size is not None:
            if not size.isdigit():
                raise OpenAIError(400, f"Content-Length is not a number: {size[:40]!r}")
            if int(size) > self.limits.max_body_bytes:
                raise OpenAIError(413, f"request body of {int(size)} bytes is over --max-message-bytes "
                                       f"{self.limits.max_body_bytes}")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        try:
            return await asyncio.wait_for(self._body(receive), self.limits.read_timeout_s)
        except TimeoutError:
            raise OpenAIError(408, f"request body not received within {self.limits.read_timeout_s:g}s") from None

    async def _body(self, receive: Receive) -> bytes:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise OpenAIError(499, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:  # a chunked body: no Content-Length said so first
                raise OpenAIError(413, f"request body over --max-message-bytes {self.limits.max_body_bytes}")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    return bearer_matches(headers.get(b"authorization", b""), key)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read here, as one message; then the connection's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_error(send: Send, error: OpenAIError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the request was never read: the connection cannot carry another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events; an error mid-stream goes out as an error object, then [DONE]."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, allow_nan=False)}\n\n"
    except OpenAIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it (its `finally` aborts the requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
        raise OpenAIError(499, "client disconnected")
    return task.result()
