"""The consumer side of a disaggregation test module: the module defines `model` (a checkpoint folder)
and `producer` (a server with the producer's role); these fixtures add a consumer pulling from it, a
colocated engine to compare tokens with, and a client that checks no page is left held after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jaxcpp import LLM
from jaxcpp.serving import Client
from jaxcpp.serving.lifecycle import ServerThread
from tests.disagg.support import assert_no_pages_held, consumer_server
from tests.pipeline.conftest import ENGINE_DEFAULTS


@pytest.fixture(scope="module")
def consumer(model: str, producer: ServerThread) -> Iterator[ServerThread]:
    server = consumer_server(model, f"127.0.0.1:{producer.port}")
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def colocated(model: str) -> LLM:
    return LLM(model=model, **ENGINE_DEFAULTS)


@pytest.fixture
def client(consumer: ServerThread, producer: ServerThread) -> Iterator[Client]:
    with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
        yield c
    assert_no_pages_held(consumer, producer)
