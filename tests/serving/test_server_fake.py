"""Server mechanics over real gRPC with the fake engine (fast): streaming, queue bound, cancellation,
deadlines, auth, TLS, size limits, metrics, engine failure, the asyncio client."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest

from jaxcpp.serving import AsyncClient, Client
from jaxcpp.serving.client import build_request
from tests.serving.conftest import started_stream, wait_until
from tests.serving.fakes import EOS, expected_tokens, fake_engine


def test_stream_gives_the_engines_tokens_and_text(fake_client: Client) -> None:
    prompt = list(b"hello")
    deltas = list(fake_client.stream(prompt, max_tokens=12, temperature=0, request_id="r1"))
    expected = expected_tokens(prompt, 12)
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == bytes(expected).decode()
    assert all(d.request_id == "r1" and d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_generated_tokens) == ("length", 5, 12)
    assert 0 < last.ttft_s <= last.e2e_s


def test_generate_joins_the_stream_and_reports_stop(serve) -> None:
    server = serve(fake_engine(eos_after=3))
    with Client(f"127.0.0.1:{server.port}") as client:
        out = client.generate("hi", max_tokens=10)
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS and len(out.token_ids) == 3
    assert out.text == bytes(out.token_ids[:-1]).decode()


def test_utf8_characters_are_never_split(serve) -> None:
    text = "héllo wörld €"  # 2- and 3-byte characters, generated one byte a step
    server = serve(fake_engine(next_token=lambda last, position, generated: text.encode()[generated]))
    with Client(f"127.0.0.1:{server.port}") as client:
        deltas = list(client.stream("x", max_tokens=len(text.encode())))
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)


def test_unset_sampling_fields_take_engine_defaults() -> None:
    from jaxcpp.serving.server import sampling_params_from_proto

    params = sampling_params_from_proto(build_request("x").sampling)
    defaults = (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed)
    assert defaults == (16, 1.0, 1.0, 0, None)
    explicit = sampling_params_from_proto(build_request("x", temperature=0, top_k=0, seed=0).sampling)
    assert (explicit.temperature, explicit.seed) == (0.0, 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-1), "top_k"),
    (dict(prompt=[5, 300], max_tokens=2), "prompt_token_ids"),
    (dict(prompt="x" * 500, max_tokens=100), "max_tokens"),
])
def test_bad_input_is_invalid_argument_naming_the_field(fake_client: Client, kwargs, field) -> None:
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        fake_client.generate(prompt, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":")
    assert fake_client.health() == "SERVING"
    assert fake_client.stats().num_in_flight == 0


def test_queue_full_is_resource_exhausted(serve) -> None:
    server = serve(fake_engine(step_delay_s=0.01), max_queue_size=2)
    with Client(f"127.0.0.1:{server.port}") as client:
        streams = [started_stream(client, "a") for _ in range(2)]
        with pytest.raises(grpc.RpcError) as err:
            client.generate("b", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue-size 2" in err.value.details()
        for s in streams:
            s.close()
        wait_until(lambda: client.stats().num_in_flight == 0)
        assert client.generate("b", max_tokens=2).finish_reason == "length"


def test_duplicate_request_id_in_flight_is_already_exists(serve) -> None:
    server = serve(fake_engine(step_delay_s=0.01))
    with Client(f"127.0.0.1:{server.port}") as client:
        first = started_stream(client, "a", request_id="same")
        with pytest.raises(grpc.RpcError) as err:
            client.generate("b", max_tokens=2, request_id="same")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.close()


def test_cancel_mid_stream_aborts_within_a_step_and_frees_pages(serve) -> None:
    engine = fake_engine(step_delay_s=0.005)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}") as client:
        stream = started_stream(client)
        next(stream)
        assert client.stats().engine.num_pages_used > 0
        stream.close()  # cancels the call
        wait_until(lambda: client.stats().engine.num_pages_used == 0)
        stats = client.stats()
        assert (stats.engine.num_running, stats.engine.num_waiting, stats.num_in_flight) == (0, 0, 0)
        assert stats.engine.num_generation_tokens_total < 50  # stopped long before max_tokens


def test_deadline_is_honoured_and_the_request_aborted(serve) -> None:
    server = serve(fake_engine(step_delay_s=0.01))
    with Client(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("abc", max_tokens=400, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: client.stats().engine.num_pages_used == 0)
        assert client.stats().num_in_flight == 0


def test_oversized_message_is_resource_exhausted(serve) -> None:
    server = serve(fake_engine(), max_message_bytes=1024)
    with Client(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x" * 2000, max_tokens=1)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.health() == "SERVING"
        assert client.generate("ok", max_tokens=1).num_generated_tokens == 1


def test_api_key_is_required_except_for_health(serve) -> None:
    server = serve(fake_engine(), api_key="s3cret")
    target = f"127.0.0.1:{server.port}"
    with Client(target) as anonymous, Client(target, api_key="wrong") as wrong:
        assert anonymous.health() == "SERVING"  # Kubernetes probes send no metadata
        for client in (anonymous, wrong):
            for call in (lambda c: c.generate("x", max_tokens=1), lambda c: c.model_info()):
                with pytest.raises(grpc.RpcError) as err:
                    call(client)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(target, api_key="s3cret") as client:
        assert client.generate("x", max_tokens=2).num_generated_tokens == 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(serve, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = serve(fake_engine(), tls_cert=str(cert), tls_key=str(key))
    with Client(f"127.0.0.1:{server.port}", root_certificates=cert) as client:
        assert client.generate("x", max_tokens=3).num_generated_tokens == 3
    with Client(f"127.0.0.1:{server.port}", timeout=5) as plaintext:
        with pytest.raises(grpc.RpcError):
            plaintext.health()


def test_health_reflection_and_model_info(fake_client: Client) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    assert fake_client.health() == "SERVING"
    assert fake_client.health("jaxcpp.v1.JaxcppService") == "SERVING"
    services = ProtoReflectionDescriptorDatabase(fake_client.channel).get_services()
    assert {"jaxcpp.v1.JaxcppService", "grpc.health.v1.Health"} <= set(services)
    info = fake_client.model_info()
    assert (info.name, info.vocab_size, info.eos_token_ids) == ("tiny", 264, (EOS,))


def test_prometheus_metrics(serve) -> None:
    """The real chunk controller's stats reach GetServerStats and Prometheus as it reports them."""
    from jaxcpp.chunking.latency_model import LatencyModel

    engine = fake_engine(pipeline_parallel_size=2, enable_dynamic_chunking=True, dynamic_chunking_policy="optimal",
                         dynamic_chunking_min_chunk_size=16)
    engine.chunking.install(LatencyModel(a=2.5e-9, b=1e-5, c=0.02, gamma=4e-7))
    assert engine.chunking.stats() == {"state": "installed", "policy": "optimal", "a": 2.5e-9, "b": 1e-5,
                                       "c": 0.02, "gamma": 4e-7, "fit_error": 0.0}
    server = serve(engine, metrics_port=0)
    with Client(f"127.0.0.1:{server.port}") as client:
        for _ in range(3):
            client.generate("abc", max_tokens=5)
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    body = urllib.request.urlopen(url).read().decode()
    for line in ("jaxcpp_time_to_first_token_seconds_count 3.0",
                 "jaxcpp_time_per_output_token_seconds_count 3.0",
                 "jaxcpp_inter_token_latency_seconds_count 12.0",
                 "jaxcpp_e2e_request_latency_seconds_count 3.0",
                 'jaxcpp_requests_finished_total{finish_reason="length"} 3.0',
                 "jaxcpp_requests_in_flight 0.0", "jaxcpp_kv_cache_pages_used 0.0",
                 "jaxcpp_compilations_since_warmup 0.0", "jaxcpp_generation_tokens_total 15.0",
                 'jaxcpp_dynamic_chunking{name="a"} 2.5e-09', 'jaxcpp_dynamic_chunking{name="gamma"} 4e-07',
                 'jaxcpp_dynamic_chunking{name="fit_error"} 0.0',
                 'jaxcpp_dynamic_chunking_info{name="state",value="installed"} 1.0',
                 'jaxcpp_dynamic_chunking_info{name="policy",value="optimal"} 1.0'):
        assert line in body, line
    with Client(f"127.0.0.1:{server.port}") as client:
        stats = client.stats()
    assert stats.engine.dynamic_chunking == {"a": 2.5e-9, "b": 1e-5, "c": 0.02, "gamma": 4e-7, "fit_error": 0.0}
    assert stats.dynamic_chunking_labels == {"state": "installed", "policy": "optimal"}


def test_engine_failure_fails_requests_and_health(serve) -> None:
    engine = fake_engine(step_delay_s=0.01)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}") as client:
        stream = started_stream(client)

        def boom() -> list:
            raise RuntimeError("device lost")

        engine.step = boom  # type: ignore[method-assign]
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "device lost" in err.value.details()
        wait_until(lambda: client.health() == "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", max_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_async_client(serve) -> None:
    server = serve(fake_engine(step_delay_s=0.001))

    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            assert await client.health() == "SERVING"
            outs = await asyncio.gather(*(client.generate([i + 1], max_tokens=8) for i in range(8)))
            for i, out in enumerate(outs):
                assert out.token_ids == expected_tokens([i + 1], 8)
            stream = client.stream("abc", max_tokens=400)
            await stream.__anext__()
            await stream.aclose()
            for _ in range(500):
                if (await client.stats()).engine.num_pages_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await client.stats()).engine.num_pages_used == 0
            assert (await client.model_info()).name == "tiny"

    asyncio.run(main())
