"""Faults inside the engine, injected through the executor: no stream hangs, and the server either
recovers with every page accounted for, or turns NOT_SERVING and `serve` exits non-zero.

- collect raises ExecutorError(fatal=False): the engine fails the requests of the steps in flight;
  their clients get INTERNAL with the message; the server recovers (SERVING, every page free).
- garbage tokens (ids outside the vocabulary): the same; the step is failed, its tokens never emitted.
- submit raises ExecutorError (fatal: a lost stage): the engine fails the steps in flight, then raises;
  every stream gets UNAVAILABLE naming the stage (the server's loss: retry elsewhere), health turns
  NOT_SERVING, `serve` exits 1 so the orchestrator restarts it. Any other exception: INTERNAL.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.executor import ExecutorError, StepResult
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.serving import Client
from tests.serving.conftest import started_stream, wait_until
from tests.serving.fakes import EOS, FAKE_ENGINE_FLAGS, expected_tokens

ROOT = Path(__file__).resolve().parents[2]


class Faulty(FakeExecutor):
    """Fails the `fail_at`-th collect (1-based) in the given way, once."""

    def __init__(self, fault: str, fail_at: int, **kw) -> None:
        super().__init__(eos_token_id=EOS, step_delay_s=0.005, **kw)
        self.fault, self.fail_at, self.collects = fault, fail_at, 0

    def submit(self, request) -> None:
        if self.fault == "submit" and len(self.steps) + 1 >= self.fail_at:
            raise ExecutorError("stage process exited with signal 9", stage=1)
        return super().submit(request)

    def collect(self, step_id: int) -> StepResult:
        result = super().collect(step_id)
        self.collects += 1
        if self.collects == self.fail_at:
            if self.fault == "collect":
                raise ExecutorError("device reported an illegal memory access", stage=0, fatal=False)
            if self.fault == "garbage" and result.tokens is not None:
                result.tokens[:] = 10**6
        return result


def faulty_engine(fault: str, fail_at: int) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(**FAKE_ENGINE_FLAGS), executor=Faulty(fault, fail_at))


@pytest.mark.parametrize("fault, message", [("collect", "illegal memory access"),
                                            ("garbage", "outside the vocabulary")])
def test_recoverable_faults_fail_the_affected_streams_and_the_server_carries_on(serve, fault, message):
    engine = faulty_engine(fault, fail_at=20)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        stream = started_stream(client)  # decoding when the fault hits
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.INTERNAL and message in err.value.details()
        assert client.health() == "SERVING"
        out = client.generate([5, 6, 7], max_tokens=8)  # the engine runs on
        assert out.token_ids == expected_tokens([5, 6, 7], 8)
        s = client.stats()
        assert (s.engine.num_pages_used, s.engine.num_running, s.engine.num_waiting, s.num_in_flight) == (0, 0, 0, 0)


def test_a_fatal_fault_fails_every_stream_and_turns_the_server_not_serving(serve):
    engine = faulty_engine("submit", fail_at=30)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        streams = [started_stream(client, prompt) for prompt in ("a", "b")]
        for stream in streams:
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "signal 9" in err.value.details()
        wait_until(lambda: client.health() == "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", max_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert engine.stats().num_pages_used == 0


SERVE_WITH_A_FATAL_FAULT = textwrap.dedent("""
    import asyncio, sys
    from jaxcpp.config import ServerConfig
    from jaxcpp.serving.lifecycle import serve
    from tests.serving.test_faults import faulty_engine

    def ready(server):
        print(server.port, flush=True)

    sys.exit(asyncio.run(serve(lambda: faulty_engine("submit", fail_at=10), ServerConfig(port=0, http_port=0),
                               on_ready=ready)))
""")


@pytest.mark.slow
def test_serve_exits_non_zero_after_a_fatal_engine_fault():
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_A_FATAL_FAULT], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with Client(f"127.0.0.1:{port}", timeout=30) as client, pytest.raises(grpc.RpcError) as err:
            client.generate("abc", max_tokens=100)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
