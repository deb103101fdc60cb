"""Client errors: every failed call raises the documented `jaxcpp.serving.ClientError` (status, field,
message), never grpc's private call objects; `wait_ready` on a dead address names the target."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

import jaxcpp.serving
from jaxcpp.serving.client import AsyncClient, Client, ClientError
from tests.serving.fakes import fake_engine


def dead_target() -> str:
    """An address nothing listens on: a port the OS just handed out and took back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def assert_invalid_top_p(err: ClientError) -> None:
    assert type(err) is ClientError
    assert err.status == grpc.StatusCode.INVALID_ARGUMENT and err.field == "top_p"
    assert err.message.startswith("top_p:") and err.code() == err.status and err.details() == err.message


def test_exported_from_jaxcpp_serving() -> None:
    assert jaxcpp.serving.ClientError is ClientError
    assert issubclass(ClientError, grpc.RpcError)  # `except grpc.RpcError` code keeps working


def test_generate_and_stream_raise_client_error_naming_the_field(fake_client: Client) -> None:
    with pytest.raises(ClientError) as err:
        fake_client.generate("hello", top_p=2.0)
    assert_invalid_top_p(err.value)
    with pytest.raises(ClientError) as err:
        list(fake_client.stream("hello", top_p=2.0))
    assert_invalid_top_p(err.value)


def test_a_message_without_a_field_leaves_field_none(serve) -> None:
    server = serve(fake_engine(step_delay_s=0.01), max_queue_size=1)  # slow steps: the stream still runs
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        stream = client.stream("a", max_tokens=400)
        next(stream)
        with pytest.raises(ClientError) as err:
            client.generate("b", max_tokens=2)
        stream.close()
    assert err.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.field is None


def test_every_call_on_a_dead_address_raises_client_error_naming_the_target() -> None:
    target = dead_target()
    with Client(target, timeout=2) as client:
        for call in (client.health, client.model_info, client.stats, lambda: client.generate("x")):
            with pytest.raises(ClientError) as err:
                call()
            assert err.value.status == grpc.StatusCode.UNAVAILABLE and target in str(err.value)
        with pytest.raises(ClientError) as err:
            client.wait_ready(timeout=0.5)
    assert err.value.status == grpc.StatusCode.UNAVAILABLE
    assert target in err.value.message and "0.5s" in err.value.message


def test_async_client_raises_client_error(serve) -> None:
    server = serve(fake_engine())

    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=30) as client:
            with pytest.raises(ClientError) as err:
                await client.generate("hello", top_p=2.0)
            assert_invalid_top_p(err.value)
            assert (await client.generate("hello", max_tokens=3)).num_generated_tokens == 3
        target = dead_target()
        async with AsyncClient(target, timeout=2) as client:
            with pytest.raises(ClientError) as err:
                await client.model_info()
            assert err.value.status == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(ClientError) as err:
                await client.wait_ready(timeout=0.5)
            assert target in err.value.message

    asyncio.run(main())
