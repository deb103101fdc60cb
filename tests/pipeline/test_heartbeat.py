"""A pipeline is not killed by its own failure detector. jax.distributed's coordination service aborts every
stage process when one sends no heartbeat for --distributed-heartbeat-timeout-s (100 s, jax's default; it
was 10 s, and a PP 2 server warming up beside other CPU-heavy work was aborted by it). A stage that dies is
still noticed at once, by its control connection. The warm-up's compile threads run at a lower priority
than the threads that send and watch heartbeats."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from jaxcpp.config import ConfigError, ParallelConfig
from tests.pipeline.conftest import child_pids


def test_the_heartbeat_timeout_is_jaxs_default_and_configurable():
    assert ParallelConfig().distributed_heartbeat_timeout_s == 100
    assert ParallelConfig(distributed_heartbeat_timeout_s=300).distributed_heartbeat_timeout_s == 300
    with pytest.raises(ConfigError, match="--distributed-heartbeat-timeout-s"):
        ParallelConfig(distributed_heartbeat_timeout_s=0)


def test_a_stage_joins_with_the_configured_heartbeat_timeout(monkeypatch):
    import jax

    from jaxcpp.runtime import stage_setup

    joined = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: joined.update(kwargs))
    stage_setup.join_coordinator("127.0.0.1:1234", "127.0.0.1", 0, 2, 100)
    assert joined["heartbeat_timeout_seconds"] == 100


def test_compile_threads_yield_to_the_other_threads():
    from jaxcpp.runtime.stage_ops import COMPILE_NICENESS, compile_buckets

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []
    stage = SimpleNamespace(compile=lambda shape, num_tokens: seen.append(priority()))
    compile_buckets([stage], SimpleNamespace(buckets=[64, 128, 192]), lambda bucket: None)
    assert seen == [min(19, priority() + COMPILE_NICENESS)] * 3
    assert priority() == priority()  # the caller's own thread keeps its priority


def _stage_pids(proc: subprocess.Popen) -> list[int]:
    return child_pids(proc.pid)


def _starve(pid: int, seconds: float) -> None:
    """No CPU at all for `seconds`: the worst a busy node does to a stage (no heartbeat is sent)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the pipeline aborted and its head killed it
            os.kill(pid, signal.SIGCONT)


def _generates(target: str) -> bool:
    from jaxcpp.serving import Client

    with Client(target, timeout=60) as client:
        return client.health() == "SERVING" and \
            client.generate([3, 4, 5], max_tokens=4, temperature=0).num_generated_tokens == 4


STARVED_S = 15  # longer than the old 10 s timeout


@pytest.mark.slow
def test_a_stage_starved_past_the_old_timeout_keeps_its_pipeline(random_model, tmp_path):
    from tests.pipeline.test_serve_lifecycle import ctrl_c, start

    proc = start(random_model, str(tmp_path / "xla-cache"), tmp_path / "serve.log")
    try:
        _starve(_stage_pids(proc)[1], STARVED_S)
        time.sleep(2)  # a verdict of the service would have arrived by now
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert _generates(proc.target)  # type: ignore[attr-defined]
    finally:
        assert ctrl_c(proc) == 0, (tmp_path / "serve.log").read_text()


@pytest.mark.slow
def test_a_short_heartbeat_timeout_is_what_aborted_it(random_model, tmp_path):
    """The failure mode, reproduced with the flag: 5 s without heartbeats and jax aborts every stage."""
    from tests.pipeline.test_serve_lifecycle import ctrl_c, start

    log = tmp_path / "serve.log"
    proc = start(random_model, str(tmp_path / "xla-cache"), log, "--distributed-heartbeat-timeout-s", "5")
    try:
        _starve(_stage_pids(proc)[1], STARVED_S)
        assert proc.wait(timeout=60) == 1, log.read_text()
        assert "stopped sending heartbeats" in log.read_text() or "SIGABRT" in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            ctrl_c(proc)


@pytest.mark.slow
def test_start_up_under_cpu_contention_then_a_dead_stage_is_noticed_at_once(random_model, tmp_path):
    """A PP 2 server warms up (cold, then twice from the cache) with a busy loop on every core, and serves;
    then a stage is killed: the control connection, not a heartbeat, tells the head within seconds."""
    from tests.pipeline.test_serve_lifecycle import ctrl_c, start

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    cache = str(tmp_path / "xla-cache")
    try:
        for run in range(3):
            log = tmp_path / f"serve{run}.log"
            proc = start(random_model, cache, log)
            try:
                assert _generates(proc.target), log.read_text()  # type: ignore[attr-defined]
                if run < 2:
                    assert ctrl_c(proc) == 0, log.read_text()
                    continue
                killed = time.monotonic()
                os.kill(_stage_pids(proc)[1], signal.SIGKILL)
                assert proc.wait(timeout=30) == 1, log.read_text()
                assert time.monotonic() - killed < 5, "noticed by the control connection, not by a heartbeat"
                assert "killed by SIGKILL" in log.read_text(), log.read_text()
            finally:
                if proc.poll() is None:
                    ctrl_c(proc)
            assert "stopped sending heartbeats" not in log.read_text()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
