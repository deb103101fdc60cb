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


def start(model: str, cache: str, log_path, *flags: str) -> subprocess.Popen:
    """`jaxcpp serve`, PP 2 on stage processes (and `flags`), in its own process group (as a shell starts a
    job); returns once it printed `serving`, with `.target` its gRPC address."""
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--port", "0", "--http-port", "0",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "64",
           "--max-num-seqs", "8", "--log-stats-interval-s", "0", "--pipeline-parallel-size", "2",
           "--distributed-executor-backend", "mp", "--shutdown-grace-s", "5", "--log-level", "info", *flags]
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


def compiled_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "bucket" in line and "stage" in line]


def test_ctrl_c_warm_start_and_log_lines(random_model, tmp_path):
    from jaxcpp.serving import Client

    cache = str(tmp_path / "xla-cache")
    cold_log, warm_log = tmp_path / "cold.log", tmp_path / "warm.log"

    proc = start(random_model, cache, cold_log)
    with Client(proc.target, timeout=60) as client:  # type: ignore[attr-defined]
        assert client.generate([3, 4, 5], max_tokens=4, temperature=0).num_generated_tokens == 4
    assert ctrl_c(proc) == 0
    cold = cold_log.read_text()

    # Ctrl-C: the stages leave quietly (no KeyboardInterrupt from their control loops), the head drains
    assert "Traceback" not in cold and "KeyboardInterrupt" not in cold, cold
    # ... and says so last: a clean exit is told from a kill
    assert cold.rstrip().splitlines()[-1].endswith("stopped: 1 requests finished, 0 aborted, 0 failed, exit 0"), cold

    # one stage numbering (0-based, as --process-id, errors and traces count): "stage 0 ... / stage 1 ..."
    stage_mentions = re.findall(r"\bstage (\d+)(/\d+)?\b", cold)
    assert stage_mentions and {n for n, _ in stage_mentions} == {"0", "1"}, stage_mentions
    assert all(of == "" for _, of in stage_mentions), "stage i/n reads as 1-based beside 0-based stage i"
    for s in (0, 1):
        assert re.search(rf"stage {s} of 2 ready", cold), cold
    cold_compiles = compiled_lines(cold)
    assert cold_compiles and all("compiled bucket" in line for line in cold_compiles), cold_compiles
    assert not any("cache" in line for line in cold_compiles), cold_compiles

    proc = start(random_model, cache, warm_log)
    assert ctrl_c(proc) == 0
    warm = warm_log.read_text()
    assert "Traceback" not in warm and "KeyboardInterrupt" not in warm, warm
    assert warm.rstrip().splitlines()[-1].endswith("stopped: 0 requests finished, 0 aborted, 0 failed, exit 0"), warm
    # a warm start says its programs came from the persistent cache instead of "compiled bucket i/n"
    warm_compiles = compiled_lines(warm)
    assert len(warm_compiles) == len(cold_compiles), (warm_compiles, cold_compiles)
    assert all(re.search(r"stage [01] loaded bucket \d+/\d+ from the compilation cache", line)
               for line in warm_compiles), warm_compiles
