"""Serving fixtures: gRPC servers on ephemeral loopback ports, around the real engine on a fake executor (fast) or the
real engine on the bundled tiny model (one per session, shared: building it compiles every bucket)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jaxcpp.config import ServerConfig
from jaxcpp.serving.client import Client, Delta
from jaxcpp.serving.lifecycle import ServerThread
from tests.serving.fakes import fake_engine

MODEL = os.environ.get("JAXCPP_TEST_MODEL", "tiny")  # the bundled model unless told otherwise
# Small enough to compile fast on 2 CPU cores, large enough for a 32-stream test.
REAL_ENGINE_KWARGS: dict[str, Any] = dict(model=MODEL, dtype="float32", max_model_len=512,
                                          max_num_batched_tokens=128, max_num_seqs=32, log_stats_interval_s=0)
MAX_MESSAGE_BYTES = 256 * 1024


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def started_stream(client: Client, prompt: str = "abc", **sampling: Any) -> Iterator[Delta]:
    """A long stream (400 tokens) whose first message has arrived: admitted and running."""
    stream = client.stream(prompt, max_tokens=400, **sampling)
    next(stream)
    return stream


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    """serve(engine, **server_config) -> a started ServerThread on 127.0.0.1:<free port>."""
    servers: list[ServerThread] = []

    def start(engine: Any, **config: Any) -> ServerThread:
        server = ServerThread(engine, ServerConfig(**{"port": 0, "http_port": 0, **config})).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


@pytest.fixture
def fake_client(serve: Callable[..., ServerThread]) -> Iterator[Client]:
    server = serve(fake_engine())
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")  # no engine outlives its module (tests/conftest.py)
def tiny_llm() -> Iterator[Any]:
    from jaxcpp import LLM

    with LLM(**REAL_ENGINE_KWARGS) as llm:
        yield llm


def offline(real_server, llm, prompts, params):
    """`LLM.generate` run on the server's engine thread: the engine has exactly one driving thread."""
    return real_server.server.engine_loop.submit(lambda: llm.generate(prompts, params)).result(timeout=300)


@pytest.fixture(scope="module")
def real_server(tiny_llm: Any) -> Iterator[ServerThread]:
    """One server around the module's tiny engine (tests must leave it idle: every page free)."""
    config = ServerConfig(port=0, http_port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    server = ServerThread(tiny_llm.engine, config).start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def real_client(real_server: ServerThread) -> Iterator[Client]:
    with Client(f"127.0.0.1:{real_server.port}", timeout=120) as client:
        yield client
