"""The HTTP port's limits, enforced early (issue 34, item 4; docs/security.md "The HTTP edge, in order"):
413 by Content-Length before the body is read, 401 before it is parsed, request heads capped (431)
and timed out with the body (slowloris). Raw sockets, on the real engine on the fake executor."""

from __future__ import annotations

import socket
import time

import pytest

from tests.serving.fakes import fake_engine
from tests.serving.raw_http import HELLO, exchange, is_error_object, post, read_response, served


def test_a_huge_content_length_is_refused_before_the_body_is_read(serve) -> None:
    server = serve(fake_engine())
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 134217728"
    status, body = exchange(server.http_port, head, timeout=5)  # no body sent: a server that reads it waits
    assert status == 413 and is_error_object(body, 413) and "--max-message-bytes" in body["error"]["message"]
    assert served(server.http_port)


def test_a_chunked_body_over_the_cap_is_refused(serve) -> None:
    server = serve(fake_engine(), max_message_bytes=4096)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    chunk = b"%x\r\n%s\r\n" % (3000, b" " * 3000)
    status, body = exchange(server.http_port, head, chunk * 3 + b"0\r\n\r\n")
    assert status == 413 and is_error_object(body, 413)


def test_the_key_is_checked_before_the_body_is_read_or_parsed(serve) -> None:
    server = serve(fake_engine(), api_key="secret")
    status, body = post(server.http_port, "/v1/completions", b"{not json")  # was: 400 for the JSON
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 134217728"
    assert exchange(server.http_port, head, timeout=5)[0] == 401  # not read: answered at once
    for scheme in ("Bearer", "bearer", "BEARER"):  # item 8: the scheme is case-insensitive
        status, _ = post(server.http_port, "/v1/completions", HELLO, headers={"Authorization": f"{scheme} secret"})
        assert status == 200, scheme
    assert post(server.http_port, "/v1/completions", HELLO, headers={"Authorization": "Basic secret"})[0] == 401
    assert exchange(server.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close")[0] == 200


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 100_000,        # one huge value (was: 200)
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-" + b"n" * 70_000 + b": 1",    # one huge name
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"\r\n".join(b"X-%d: 1" % i for i in range(200)),  # many
])
def test_oversized_request_heads_get_431(serve, head: bytes) -> None:
    server = serve(fake_engine())
    status, body = exchange(server.http_port, head)
    assert status in (431, 0), status  # 0: closed before the head ended (the client may still be sending)
    if status:
        assert is_error_object(body, 431)
    assert served(server.http_port)


def test_slow_and_idle_clients_are_disconnected_within_the_timeout(serve) -> None:
    server = serve(fake_engine(), http_read_timeout_s=1.0)
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as slow, \
            socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as idle:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with pytest.raises(OSError):  # the server closes it while it still trickles a header byte a time
            for _ in range(40):
                slow.sendall(b"X")
                time.sleep(0.1)
        assert time.monotonic() - start < 3.5
        assert read_response(idle)[0] in (408, 0)  # never sent a byte: closed too
    assert time.monotonic() - start < 4.0


def test_a_slow_body_gets_408(serve) -> None:
    server = serve(fake_engine(), http_read_timeout_s=1.0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100"
    start = time.monotonic()
    status, body = exchange(server.http_port, head, b'{"prompt"')
    assert status == 408 and is_error_object(body, 408) and time.monotonic() - start < 3.5
    assert served(server.http_port)


