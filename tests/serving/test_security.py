"""Security: the API key on every method but health (walked from the service descriptors), the key from
a file or the environment, mutual TLS, reflection off, and the text prompt's size cap."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from jaxcpp.config import API_KEY_ENV, ConfigError, ServerConfig
from jaxcpp.serving import Client
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.security import check_files, resolve_api_key
from tests.serving.fakes import fake_engine

KEY = "k3y-for-tests"
_SERVICES = [pb.DESCRIPTOR.services_by_name["JaxcppService"],
             health_pb2.DESCRIPTOR.services_by_name["Health"],
             reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]


def _methods() -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method the server offers."""
    return [(f"/{svc.full_name}/{m.name}", m.client_streaming, m.server_streaming)
            for svc in _SERVICES for m in svc.methods]


def _call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
          metadata: tuple = ()) -> grpc.StatusCode:
    """Call `path` with an empty request (raw bytes); the status code it ends with."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, True): channel.stream_stream}[(client_streaming, server_streaming)]
    method = kind(path, request_serializer=None, response_deserializer=None)
    request = iter([b""]) if client_streaming else b""
    try:
        result = method(request, timeout=5, metadata=metadata)
        if server_streaming:
            next(iter(result), None)  # Health.Watch streams forever: the first message is enough
            result.cancel()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_every_method_but_health_requires_the_key(serve) -> None:
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    server = serve(fake_engine(), api_key=KEY)
    methods = _methods()
    assert len(methods) == 7  # Generate, GetModelInfo, GetServerStats, Check, List, Watch, reflection
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            metadata=(("authorization", f"Bearer {KEY}"),), timeout=5)
        offered = {s.name for s in next(answers).list_services_response.service}
        assert offered == {svc.full_name for svc in _SERVICES}  # the walk below covers all it offers
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for path, cs, ss in methods:
            anonymous = _call(channel, path, cs, ss)
            wrong = _call(channel, path, cs, ss, metadata=(("authorization", "Bearer nope"),))
            if path.startswith("/grpc.health.v1.Health/"):  # open (List is not implemented by grpc)
                assert anonymous == wrong != grpc.StatusCode.UNAUTHENTICATED, path
            else:
                assert anonymous == wrong == grpc.StatusCode.UNAUTHENTICATED, path
                keyed = _call(channel, path, cs, ss, metadata=(("authorization", f"Bearer {KEY}"),))
                # with the key the call gets past auth: an empty Generate is then a bad prompt
                assert keyed != grpc.StatusCode.UNAUTHENTICATED, path


def test_key_from_a_file_and_from_the_environment(serve, tmp_path: Path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    for config in (dict(api_key_file=str(key_file)), {}):
        if not config:
            monkeypatch.setenv(API_KEY_ENV, KEY)
        server = serve(fake_engine(), **config)
        with Client(f"127.0.0.1:{server.port}") as anonymous, pytest.raises(grpc.RpcError) as err:
            anonymous.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(f"127.0.0.1:{server.port}", api_key=KEY) as client:
            assert client.generate("x", max_tokens=2).num_generated_tokens == 2


def test_key_flags_are_checked(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="--api-key-file: no such file"):
        check_files(ServerConfig(api_key_file=str(tmp_path / "missing")))  # at start-up (the CLI, Server)
    with pytest.raises(ConfigError, match="--api-key-file: give --api-key or --api-key-file"):
        ServerConfig(api_key="a", api_key_file=str(empty))
    with pytest.raises(ConfigError, match="--api-key-file: .* is empty"):
        resolve_api_key(ServerConfig(api_key_file=str(empty)))
    with pytest.raises(ConfigError, match="--tls-client-ca: mutual TLS needs"):
        ServerConfig(tls_client_ca=str(empty))


def test_a_missing_file_is_named_before_anything_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    """The files are checked at start-up, not in ServerConfig (which holds values only): `jaxcpp serve`
    stops before it listens or loads, and a Server built in Python refuses too."""
    from jaxcpp.serving.cli import main
    from jaxcpp.serving.lifecycle import Server

    missing = str(tmp_path / "missing.pem")
    config = ServerConfig(tls_cert=missing, tls_key=missing)  # values: accepted
    monkeypatch.setattr("jaxcpp.serving.lifecycle.serve", lambda *a, **k: pytest.fail("serve started"))
    assert main(["serve", "--tls-cert", missing, "--tls-key", missing]) == 2
    assert f"--tls-cert: no such file: {missing!r}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--tls-cert: no such file"):
        Server(None, config)


def test_cli_warns_that_a_key_on_the_command_line_shows_in_ps() -> None:
    from jaxcpp.cli_args import server_config_from_args
    from jaxcpp.serving.cli import build_parser, command_line_key_warning

    args = build_parser().parse_args(["serve", "--api-key", "abc"])
    assert server_config_from_args(args).api_key == "abc"
    assert "ps" in command_line_key_warning(args) and API_KEY_ENV in command_line_key_warning(args)
    assert command_line_key_warning(build_parser().parse_args(["serve"])) is None


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca_and_leaf(tmp_path: Path, name: str, cn: str,
                 names: str = "DNS:localhost,IP:127.0.0.1") -> tuple[Path, Path, Path]:
    """A CA and a certificate it signed for `cn`, valid for `names` (subjectAltName)."""
    ca_key, ca = tmp_path / f"{name}-ca.key", tmp_path / f"{name}-ca.pem"
    key, csr, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.csr", tmp_path / f"{name}.pem"
    ext = tmp_path / f"{name}.ext"
    ext.write_text(f"subjectAltName={names}\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name} CA",
             "-keyout", str(ca_key), "-out", str(ca))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(key),
             "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_requires_a_client_certificate_from_the_ca(serve, tmp_path: Path) -> None:
    server_ca, server_cert, server_key = _ca_and_leaf(tmp_path, "server", "localhost")
    client_ca, client_cert, client_key = _ca_and_leaf(tmp_path, "client", "alice")
    rogue_ca, rogue_cert, rogue_key = _ca_and_leaf(tmp_path, "rogue", "mallory")
    server = serve(fake_engine(), tls_cert=str(server_cert), tls_key=str(server_key),
                   tls_client_ca=str(client_ca))
    target = f"127.0.0.1:{server.port}"

    def channel(cert: Path | None, key: Path | None) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=server_ca.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None)
        return grpc.secure_channel(target, creds)

    ok = channel(client_cert, client_key)
    check = ok.unary_unary("/grpc.health.v1.Health/Check",
                           request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                           response_deserializer=health_pb2.HealthCheckResponse.FromString)
    assert check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    ok.close()
    for cert, key in ((None, None), (rogue_cert, rogue_key)):
        with channel(cert, key) as bad:
            with pytest.raises(grpc.RpcError) as err:
                bad.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_client_tls_ca_and_server_name(serve, tmp_path: Path, capsys) -> None:
    """`jaxcpp client --tls-ca` trusts that CA; `--server-name` verifies the name the certificate carries
    when it is not the target's host (here: a certificate for jaxcpp.internal, reached at 127.0.0.1)."""
    from jaxcpp.serving.cli import main

    ca, cert, key = _ca_and_leaf(tmp_path, "server", "jaxcpp.internal", names="DNS:jaxcpp.internal")
    server = serve(fake_engine(), tls_cert=str(cert), tls_key=str(key))
    base = ["client", "--health", "--target", f"127.0.0.1:{server.port}", "--timeout", "10"]
    assert main([*base, "--tls-ca", str(ca), "--server-name", "jaxcpp.internal"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main([*base, "--tls-ca", str(ca)]) == 1  # 127.0.0.1 is not a name the certificate carries
    other_ca, _, _ = _ca_and_leaf(tmp_path, "other", "jaxcpp.internal", names="DNS:jaxcpp.internal")
    assert main([*base, "--tls-ca", str(other_ca), "--server-name", "jaxcpp.internal"]) == 1  # not its CA
    assert main(base) == 1  # plaintext against a TLS port
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_reflection_can_be_turned_off(serve) -> None:
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    on, off = serve(fake_engine()), serve(fake_engine(), enable_reflection=False)
    for server, want in ((on, grpc.StatusCode.OK), (off, grpc.StatusCode.UNIMPLEMENTED)):
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert _call(channel, path, True, True) == want


def _generate_unlimited(port: int, text: str) -> grpc.RpcError:
    """Generate over a channel whose own send limit is above 100 MB: only the server may refuse."""
    big = 256 * 1024 * 1024
    options = [("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        method = channel.unary_stream("/jaxcpp.v1.JaxcppService/Generate",
                                      request_serializer=pb.GenerateRequest.SerializeToString,
                                      response_deserializer=pb.GenerateResponse.FromString)
        request = pb.GenerateRequest(text=text, sampling=pb.SamplingParameters(max_tokens=1))
        with pytest.raises(grpc.RpcError) as err:
            list(method(request, timeout=60))
    return err.value


def test_a_100_mb_prompt_is_refused_before_tokenizing(serve) -> None:
    engine = fake_engine()
    encoded: list[int] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text: encoded.append(len(text)) or encode(text)  # type: ignore[method-assign]
    # the gRPC message limit raised past 100 MB so that only --max-prompt-bytes stands in the way
    server = serve(engine, max_message_bytes=128 * 1024 * 1024, max_prompt_bytes=64 * 1024)
    start = time.monotonic()
    err = _generate_unlimited(server.port, "x" * (100 * 1024 * 1024))
    elapsed = time.monotonic() - start
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("text: prompt text is over --max-prompt-bytes 65536"), err.details()
    assert encoded == []  # refused before the tokenizer saw it
    print(f"100 MB prompt refused by --max-prompt-bytes in {elapsed:.2f} s (loopback transfer included)")
    with Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        at_cap = "é" * (32 * 1024 + 1)  # 32 Ki + 1 characters = 64 KiB + 2 bytes: bytes are counted
        with pytest.raises(grpc.RpcError) as info:
            client.generate(at_cap, max_tokens=1)
        assert info.value.details().startswith("text: ")
        assert client.generate("é" * 100, max_tokens=1).num_generated_tokens == 1
    default = serve(fake_engine())  # default limits: gRPC's 4 MiB message cap refuses it first
    start = time.monotonic()
    err = _generate_unlimited(default.port, "x" * (100 * 1024 * 1024))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    print(f"100 MB prompt refused by --max-message-bytes in {time.monotonic() - start:.2f} s")
