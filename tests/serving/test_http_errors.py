"""Every HTTP error is an OpenAI error object (issue 34, item 8): bodies that are not a JSON object
(not JSON, invalid UTF-8, 5,000-digit numbers, deep nesting), unknown routes, wrong methods. Raw
sockets, on the real engine on the fake executor."""

from __future__ import annotations

import pytest

from tests.serving.conftest import wait_until
from tests.serving.fakes import fake_engine
from tests.serving.raw_http import exchange, is_error_object, post, served


@pytest.mark.parametrize(("body", "says"), [
    (b"not json", "not valid JSON"),  # was: {"message": "0: JSON decode error", "param": "0"}
    (b'{"prompt": "\xff\xfe"}', "could not be parsed as JSON"),  # invalid UTF-8 (was: {"detail": ...})
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "could not be parsed as JSON"),  # past 4,300 digits
    (b"[" * 5000 + b"]" * 5000, "could not be parsed as JSON"),  # nesting past the recursion limit
    (b"[1, 2]", "must be a JSON object"),
    (b"", "must be a JSON object"),
])
def test_bodies_that_are_not_a_json_object_get_an_error_object(serve, body: bytes, says: str) -> None:
    server = serve(fake_engine())
    status, answer = post(server.http_port, "/v1/completions", body)
    assert status == 400 and is_error_object(answer, 400), answer
    assert says in answer["error"]["message"] and answer["error"]["param"] is None, answer
    assert served(server.http_port)


def test_unknown_routes_and_wrong_methods_get_error_objects(serve) -> None:
    server = serve(fake_engine())
    status, body = exchange(server.http_port, b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close")
    assert status == 404 and is_error_object(body, 404) and "/v1/nothing" in body["error"]["message"]
    status, body = exchange(server.http_port, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close")
    assert status == 405 and is_error_object(body, 405) and "POST" in body["error"]["message"], body
    wait_until(lambda: served(server.http_port))
