"""Raw HTTP/1.1 over a socket, for tests of what a well-behaved client library would never send."""

from __future__ import annotations

import json
import socket
from typing import Any


def exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, Any]:
    """Send `head` (request line and headers, without the blank line) and `body`; (status, parsed JSON
    body or the raw bytes). A connection closed without an answer is status 0."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        return read_response(sock)


def post(port: int, path: str, body: bytes, *, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {len(body)}",
             "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return exchange(port, "\r\n".join(lines).encode(), body)


def read_response(sock: socket.socket) -> tuple[int, Any]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    try:
        return status, json.loads(rest)
    except ValueError:
        return status, rest


HELLO = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def served(port: int) -> bool:
    status, body = post(port, "/v1/completions", HELLO)
    return status == 200 and body["choices"][0]["finish_reason"] == "length"


def is_error_object(body: Any, status: int) -> bool:
    """OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with a message that says something."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and \
        len(error["message"]) > 10 and error["code"] in (status, error["code"])
