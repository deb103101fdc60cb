"""SIGTERM to a real `jaxcpp serve` under load: short streams finish within the grace period, a new
call gets UNAVAILABLE, the streams still running when the grace ends finish with reason ABORT, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from jaxcpp.serving import Client
from tests.serving.conftest import MODEL, wait_until

pytestmark = pytest.mark.slow

GRACE_S = 2.0
LONG = 2000  # tokens: at ~3 ms a decode step (decode-only buckets), 480 could finish within the grace
# Long enough that all 8 streams are admitted before a short one ends (at 12 tokens, ~40 ms, a stream
# whose client connected late could find a short one finished, and 8 running never came), short
# enough to end well inside the grace (~0.2 s at ~3 ms a step).
SHORT = 64


def test_sigterm_under_load(tmp_path) -> None:
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", MODEL, "--port", "0", "--http-port", "0",
           "--max-model-len", "2048", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
           "--log-stats-interval-s", "0", "--shutdown-grace-s", str(GRACE_S), "--log-level", "warning"]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=os.environ.copy())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("jaxcpp: serving"), (line, log.read_text())
        target = line.split(" on ")[1].split()[0]
        results: dict[str, list] = {}
        errors: dict[str, grpc.RpcError] = {}

        def consume(name: str, max_tokens: int) -> None:
            with Client(target, timeout=120) as client:
                try:
                    results[name] = list(client.stream(f"def {name}():", max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
                except grpc.RpcError as err:
                    errors[name] = err

        # short: done well inside the grace; long: still running when it ends
        jobs = {f"short{i}": SHORT for i in range(4)} | {f"long{i}": LONG for i in range(4)}
        threads = [threading.Thread(target=consume, args=job, daemon=True) for job in jobs.items()]
        with Client(target, timeout=60) as probe:
            for t in threads:
                t.start()
            wait_until(lambda: probe.stats().engine.num_running == 8, timeout=60)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            wait_until(lambda: _refused(target), timeout=GRACE_S)  # while the long streams still run
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=60) == 0, log.read_text()
        took = time.monotonic() - signalled
        assert errors == {}
        for name, deltas in results.items():
            last = deltas[-1]
            if name.startswith("short"):
                assert (last.finish_reason, last.num_generated_tokens) == ("length", SHORT)
            else:
                assert last.finish_reason == "abort" and last.num_generated_tokens < LONG, name
                assert sum(len(d.token_ids) for d in deltas) == last.num_generated_tokens
        assert len(results) == 8
        print(f"SIGTERM under load: exit 0 after {took:.1f} s (grace {GRACE_S} s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _refused(target: str) -> bool:
    """True once a new Generate call is refused with UNAVAILABLE (the server is draining)."""
    with Client(target, timeout=5) as late:
        try:
            late.generate("new", max_tokens=1)
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.UNAVAILABLE
    return False
