"""Graceful shutdown: SIGTERM drains a real `jaxcpp serve` process; past the grace period, requests
are aborted and their streams end with finish reason ABORT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from jaxcpp.serving import Client
from tests.serving.conftest import MODEL, started_stream, wait_until
from tests.serving.fakes import fake_engine


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path) -> None:
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", MODEL, "--port", "0", "--http-port", "0",
           "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
           "--log-stats-interval-s", "0", "--shutdown-grace-s", "60", "--log-level", "warning"]
    log = tmp_path / "serve.log"  # a file, not a pipe nobody reads
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                            env=os.environ.copy())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("jaxcpp: serving"), (line, log.read_text())
        target = line.split(" on ")[1].split()[0]
        with Client(target, timeout=120) as client:
            assert client.health() == "SERVING"
            deltas: list = []
            done = threading.Event()

            def consume() -> None:
                for d in client.stream("def main():", max_tokens=60, ignore_eos=True, temperature=0):
                    deltas.append(d)
                done.set()

            threading.Thread(target=consume, daemon=True).start()
            wait_until(lambda: deltas, timeout=60)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
            assert done.wait(5)
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_generated_tokens == 60
        with Client(target, timeout=5) as late, pytest.raises(grpc.RpcError) as err:
            late.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_past_the_grace_period_in_flight_calls_end_with_finish_reason_abort(serve) -> None:
    engine = fake_engine(step_delay_s=0.01)
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}") as client:
        stream = started_stream(client)
        server.stop(grace=0.2)
        deltas = list(stream)
        assert deltas[-1].finish_reason == "abort" and deltas[-1].num_generated_tokens < 400
    stats = engine.stats()
    assert (stats.num_pages_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
