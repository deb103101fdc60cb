"""Health over a server's life, as an orchestrator's probes see it (docs/deploy.md): NOT_SERVING while the
engine is being built (the service's RPCs answer UNAVAILABLE "warming up"), SERVING once it is attached,
NOT_SERVING again as soon as a drain starts, while the calls in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from jaxcpp.config import ServerConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.serving import AsyncClient, Client
from jaxcpp.serving.lifecycle import Server, ServerThread
from jaxcpp.serving.server import SERVICE_NAME
from tests.serving.conftest import MODEL, wait_until
from tests.serving.fakes import FAKE_ENGINE_FLAGS, fake_engine


class SlowFactory:
    """An engine factory that blocks until released, like a long compile."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self) -> LLMEngine:
        self.started.set()
        assert self.release.wait(30), "the test never released the factory"
        return fake_engine()


@pytest.fixture
def warming_server():
    server = ServerThread(None, ServerConfig(port=0, http_port=0, api_key="k")).start()
    yield server
    server.stop(grace=0)


def test_not_serving_while_the_engine_builds_then_serving(warming_server) -> None:
    factory = SlowFactory()
    built = warming_server.build_engine(factory)
    assert factory.started.wait(10)
    with Client(f"127.0.0.1:{warming_server.port}", api_key="k", timeout=10) as client:
        for service in ("", SERVICE_NAME):
            assert client.health(service) == "NOT_SERVING"
        for call in (client.model_info, client.stats, lambda: client.generate("abc", max_tokens=2)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details().startswith("warming up")
        assert not built.done()
        factory.release.set()
        built.result(timeout=10)
        for service in ("", SERVICE_NAME):
            assert client.health(service) == "SERVING"
        out = client.generate("abc", max_tokens=3, temperature=0)
        assert out.num_generated_tokens == 3
        assert client.model_info().max_model_len == FAKE_ENGINE_FLAGS["max_model_len"]


def test_wait_ready_returns_only_once_the_server_is_serving(warming_server) -> None:
    """A script that calls wait_ready() and then generate() must not meet "warming up"."""
    factory = SlowFactory()
    built = warming_server.build_engine(factory)
    assert factory.started.wait(10)
    with Client(f"127.0.0.1:{warming_server.port}", api_key="k", timeout=10) as client:
        client.wait_connected(timeout=5)  # the channel is up: what wait_ready used to wait for
        with pytest.raises(grpc.RpcError) as err:
            client.wait_ready(timeout=0.5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not ready within 0.5s: its health is NOT_SERVING" in err.value.details()
        assert_async_wait_ready_times_out(warming_server.port)
        threading.Timer(0.5, factory.release.set).start()
        client.wait_ready(timeout=10)
        assert built.result(timeout=10) is None
        assert client.generate("abc", max_tokens=2, temperature=0).num_generated_tokens == 2


def assert_async_wait_ready_times_out(port: int) -> None:
    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{port}", timeout=10) as client:
            await client.wait_connected(timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                await client.wait_ready(timeout=0.5)
            assert "its health is NOT_SERVING" in err.value.details()

    asyncio.run(main())


def test_the_api_key_is_checked_before_the_warm_up_answer(warming_server) -> None:
    with Client(f"127.0.0.1:{warming_server.port}", api_key="wrong", timeout=10) as client:
        assert client.health() == "NOT_SERVING"  # probes need no key
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_factory_that_fails_leaves_health_not_serving(warming_server) -> None:
    def broken() -> LLMEngine:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        warming_server.build_engine(broken).result(timeout=10)
    with Client(f"127.0.0.1:{warming_server.port}", timeout=10) as client:
        assert client.health() == "NOT_SERVING"


def test_health_turns_not_serving_as_the_drain_starts_and_calls_in_flight_finish(monkeypatch) -> None:
    monkeypatch.setattr(Server, "drain_announce_s", 5.0)  # a wide window: the probe below must land in it
    server = ServerThread(fake_engine(step_delay_s=0.005), ServerConfig(port=0, http_port=0)).start()
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=10) as client:
            stream = client.stream("abc", max_tokens=100, temperature=0)
            next(stream)
            stopping = threading.Thread(target=server.stop, kwargs={"grace": 30.0})
            stopping.start()
            with Client(f"127.0.0.1:{server.port}", timeout=5) as probe:  # raises once the listener closes
                wait_until(lambda: probe.health() == "NOT_SERVING", timeout=4)
            deltas = list(stream)
            assert deltas[-1].finish_reason == "length" and deltas[-1].num_generated_tokens == 100
            stopping.join(timeout=30)
            assert not stopping.is_alive()
    finally:
        server.stop(grace=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", MODEL, "--port", str(port),
            "--http-port", "0", "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
            "--log-stats-interval-s", "0", "--log-level", "warning"]


def _statuses_until_serving(client: Client, proc: subprocess.Popen, timeout: float) -> list[str]:
    """Poll health every 20 ms from process start; every distinct status seen, in order."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = client.health(timeout=2)
        except grpc.RpcError:  # not listening yet
            status = "NO_ANSWER"
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "SERVING":
            return seen
        time.sleep(0.02)
    raise AssertionError(f"never SERVING: saw {seen}, exit code {proc.poll()}")


@contextlib.contextmanager
def _serve_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Client, Path]]:
    """A `jaxcpp serve` subprocess on a free port, a client for it, and its log; killed if still running."""
    port = _free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(_serve_cmd(port), stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env=os.environ.copy())
    try:
        with Client(f"127.0.0.1:{port}", timeout=5) as client:
            yield proc, client, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_jaxcpp_serve_answers_not_serving_during_the_compile_then_serving(tmp_path) -> None:
    with _serve_process(tmp_path) as (proc, client, log):
        seen = _statuses_until_serving(client, proc, timeout=300)
        assert [s for s in seen if s != "NO_ANSWER"] == ["NOT_SERVING", "SERVING"], (seen, log.read_text())
        assert "listening on" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


PROMPT_EXIT_S = 5.0  # an orchestrator's grace period must not run out while a warm-up winds down (a
# cold compile of every bucket takes a minute here; 2.0 s broke once at load 17 with the interpreter's exit)


def _wait_for_line(log: Path, proc: subprocess.Popen, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.01)


def _seconds_to_exit_after_sigterm(proc: subprocess.Popen, log: Path) -> float:
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 60 s after SIGTERM:\n{log.read_text()}") from None
    assert code == 0, log.read_text()
    return time.monotonic() - sent


@pytest.mark.slow
def test_sigterm_during_warm_up_exits_0(tmp_path) -> None:
    with _serve_process(tmp_path) as (proc, client, log):
        _wait_for_line(log, proc, "listening on")  # loading the weights
        assert client.health() == "NOT_SERVING"
        assert _seconds_to_exit_after_sigterm(proc, log) < PROMPT_EXIT_S


@pytest.mark.slow
def test_sigterm_in_the_middle_of_compiling_every_bucket_exits_0_at_once(tmp_path) -> None:
    """25 programs on a cold compile cache take a minute here: a stop must not wait for them."""
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [*_serve_cmd(port)[:-2], "--log-level", "info", "--max-num-batched-tokens", "2048"]
    env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
    try:
        _wait_for_line(log, proc, "compiled bucket 1/")
        assert "engine ready" not in log.read_text()
        assert _seconds_to_exit_after_sigterm(proc, log) < PROMPT_EXIT_S
        assert "stopped during warm-up" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
