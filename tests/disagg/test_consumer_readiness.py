"""A consumer serves only while a producer can prefill: its gRPC health answers NOT_SERVING and HTTP /health 503
until one of its --prefill-servers answers SERVING, and again once none does; a request that finds no ready
producer is refused UNAVAILABLE / 503 saying so (retryable), not INTERNAL / 500. The producer here is a real
`jaxcpp serve` server still warming up (health NOT_SERVING, its service answering "warming up"), then given
its engine, then stopped."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from jaxcpp import LLM
from jaxcpp.config import ServerConfig
from jaxcpp.serving import Client, ClientError
from jaxcpp.serving.lifecycle import ServerThread
from tests.disagg.support import PRODUCER, consumer_server
from tests.pipeline.conftest import ENGINE_DEFAULTS, write_random_model

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_model(tmp_path_factory.mktemp("readiness_model"), num_layers=2)


def http_status(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def refused_unavailable(client: Client, port: int) -> tuple[str, int, str]:
    """A gRPC and an HTTP request to the consumer: the gRPC status name and message, the HTTP status."""
    with pytest.raises(ClientError) as err:
        client.generate(PROMPT, max_tokens=4, temperature=0)
    model = client.model_info().name  # the name the HTTP API serves it under
    status, _ = http_status(port, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 4})
    return err.value.status.name, status, str(err.value)


def test_a_consumer_serves_only_while_a_producer_is_ready(model: str) -> None:
    producer = ServerThread(None, ServerConfig(port=0, enable_http=False)).start()  # warming up
    consumer = consumer_server(model, f"127.0.0.1:{producer.port}")
    try:
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as client:
            time.sleep(2)  # the consumer has checked its producer by now, and keeps checking
            assert client.health() == "NOT_SERVING"
            assert http_status(consumer.http_port, "/health")[0] == 503
            code, http, message = refused_unavailable(client, consumer.http_port)
            assert (code, http) == ("UNAVAILABLE", 503), message
            assert "no prefill server" in message and "warming up" in message.lower(), message

            # the producer's engine is ready: the consumer follows within a check or two
            llm = LLM(model=model, **ENGINE_DEFAULTS, kv_transfer_config=PRODUCER)
            producer.build_engine(lambda: llm.engine).result(timeout=120)
            assert eventually(lambda: client.health() == "SERVING")
            assert http_status(consumer.http_port, "/health")[0] == 200
            assert client.generate(PROMPT, max_tokens=4, temperature=0).num_generated_tokens == 4

            producer.stop(grace=0)  # the only producer is gone: not serving again
            assert eventually(lambda: client.health() == "NOT_SERVING")
            assert http_status(consumer.http_port, "/health")[0] == 503
            code, http, message = refused_unavailable(client, consumer.http_port)
            assert (code, http) == ("UNAVAILABLE", 503), message
    finally:
        producer.stop(grace=0)
        consumer.stop(grace=0)


def test_a_request_no_producer_can_prefill_is_retryable(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the front door (readiness changed meanwhile), the producer still answers "warming up": the request
    ends UNAVAILABLE / 503, the error a client retries, not INTERNAL / 500."""
    producer = ServerThread(None, ServerConfig(port=0, enable_http=False)).start()
    consumer = consumer_server(model, f"127.0.0.1:{producer.port}")
    remote = consumer.server.engine_loop.engine.remote
    monkeypatch.setattr(remote, "unready_reason", lambda: None, raising=False)  # as if a check had just seen it SERVING
    try:
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as client:
            code, http, message = refused_unavailable(client, consumer.http_port)
            assert (code, http) == ("UNAVAILABLE", 503), message
            assert "no producer could prefill it" in message and "warming up" in message, message
    finally:
        producer.stop(grace=0)
        consumer.stop(grace=0)

