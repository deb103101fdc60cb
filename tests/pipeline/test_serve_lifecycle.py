"""A stage-process server's life as an operator sees it in its log: start-up lines that tell the truth (one
stage numbering, which buckets came from the persistent compilation cache), Ctrl-C on the terminal (SIGINT
to the whole process group) that ends quietly, and a closing line that tells a clean exit from a kill.
Two starts of one PP 2 server on a small random model, the second warm from the first's cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def start(model: str, cache: str, log_path) -> subprocess.Popen:
    """`jaxcpp serve`, PP 2 on stage processes, in its own process group (as a shell starts a job); returns
    once it printed `serving`."""
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--port", "0", "--http-port", "0",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "64",
           "--max-num-seqs", "8", "--log-stats-interval-s", "0", "--pipeline-parallel-size", "2",
           "--distributed-executor-backend", "mp", "--shutdown-grace-s", "5", "--log-level", "info"]
    env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": cache, "JAXCPP_STAGE_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True, env=env,
                            process_group=0)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("jaxcpp: serving"), (line, log_path.read_text())
    proc.target = line.split(" on ")[1].split()[0]  # type: ignore[attr-defined]
    return proc


def ctrl_c(proc: subprocess.Popen) -> int:
    """SIGINT to the server's whole process group, as a terminal sends it: the head and its stages."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        return proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_ends_quietly(random_model, tmp_path):
    from jaxcpp.serving import Client

    log_path = tmp_path / "serve.log"
    proc = start(random_model, str(tmp_path / "xla-cache"), log_path)
    with Client(proc.target, timeout=60) as client:  # type: ignore[attr-defined]
        assert client.generate([3, 4, 5], max_tokens=4, temperature=0).num_generated_tokens == 4
    assert ctrl_c(proc) == 0
    log = log_path.read_text()
    # Ctrl-C: the stages leave quietly (no KeyboardInterrupt from their control loops), the head drains
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "pipeline failed" not in log, log
