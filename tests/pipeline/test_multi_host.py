"""A pipeline over two hosts on real interfaces: two network namespaces joined by a veth pair (`netns`),
the head and stage 0 on host a (10.231.77.1), stage 1 on host b (10.231.77.2), each started as an
operator would (`jaxcpp serve --num-processes 2 --process-id I --coordinator-address 10.231.77.1:8476`,
a shared JAXCPP_CONTROL_KEY). Checked: the addresses each process publishes (the same the
LeaderWorkerSet manifests give, tests/deploy); the single-device tokens over gRPC (chunked prefill,
concurrent requests, async scheduling); SIGTERM on the head drains and both hosts exit 0; a SIGKILLed
remote stage ends the streams UNAVAILABLE naming it and `serve` exits non-zero promptly (the control
connection, not a heartbeat); the head's death ends the remote stage; a host that advertises loopback
is refused in one line naming the stage, host and addresses. Skipped, with the reason, where namespaces
cannot be made (not root).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.netns import COORDINATOR, HEAD_IP, STAGE_IP, TwoHosts, expected_addresses
from tests.pipeline.test_pipeline_exactness import GREEDY, SAMPLING, prompts
from tests.pipeline.test_stage_processes import wait_gone

pytestmark = pytest.mark.slow

PORT = 50051
START_TIMEOUT_S = 300
READY = re.compile(r"stage (\d+) of 2 ready: pid (\d+) on \S+ at (\S+), transfer server (\S+):(\d+)")


def _sampling(params: Any) -> dict[str, Any]:
    fields = ("max_tokens", "temperature", "top_k", "seed", "ignore_eos")
    return {f: getattr(params, f) for f in fields if getattr(params, f) not in (None, -1)}


class Pair:
    """`jaxcpp serve` as process 0 on host a (the head, which spawns stage 0) and as process 1 on host b."""

    def __init__(self, hosts: TwoHosts, model: str, logs: Path, stage_flags: list[str]) -> None:
        self.hosts, self.logs = hosts, logs
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as on hosts of their own
        env["JAXCPP_CONTROL_KEY"] = secrets.token_hex(32)
        serve = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--dtype", "float32",
                 "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
                 "--log-stats-interval-s", "0", "--pipeline-parallel-size", "2", "--num-processes", "2",
                 "--coordinator-address", COORDINATOR, "--shutdown-grace-s", "20"]
        with (logs / "head.log").open("w") as head_log, (logs / "stage.log").open("w") as stage_log:
            self.head = hosts.popen("a", [*serve, "--process-id", "0", "--host", HEAD_IP, "--port", str(PORT)],
                                    env=env, stdout=subprocess.PIPE, stderr=head_log, text=True)
            self.stage = hosts.popen("b", [*serve, "--process-id", "1", *stage_flags], env=env,
                                     stdout=subprocess.DEVNULL, stderr=stage_log)
        self.stage0: int | None = None

    def log(self, which: str = "head") -> str:
        return (self.logs / f"{which}.log").read_text()

    def wait_serving(self) -> None:
        assert self.head.stdout is not None
        readable, _, _ = select.select([self.head.stdout], [], [], START_TIMEOUT_S)
        line = self.head.stdout.readline() if readable else ""
        assert line.startswith("jaxcpp: serving"), (line, self.log(), self.log("stage"))
        children = [int(p) for task in Path(f"/proc/{self.head.pid}/task").iterdir()
                    for p in (task / "children").read_text().split()]  # spawned from the engine's thread
        [self.stage0] = children

    def client(self, requests: list[dict[str, Any]]) -> subprocess.Popen[str]:
        return self.hosts.popen("a", [sys.executable, "-m", "tests.pipeline.netns_client", f"{HEAD_IP}:{PORT}",
                                      json.dumps(requests)], stdout=subprocess.PIPE, text=True)

    def close(self) -> None:
        for proc in (self.head, self.stage):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def started(client: subprocess.Popen[str]) -> None:
    assert client.stdout is not None
    assert client.stdout.readline().startswith("STARTED"), "the client's requests did not start"


def results(client: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, _ = client.communicate(timeout=120)
    return json.loads(out.splitlines()[-1])


def exit_time(proc: subprocess.Popen[Any], since: float, timeout: float) -> float:
    """Seconds from `since` until `proc` exited (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is not None, f"still running {timeout:.0f}s later"
    return time.monotonic() - since


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts.create() as two:
        yield two


@pytest.fixture
def start_pair(hosts, random_model, tmp_path):
    pairs: list[Pair] = []

    def start(stage_flags: tuple[str, ...] = (), serving: bool = True) -> Pair:
        pair = Pair(hosts, random_model, tmp_path, list(stage_flags))
        pairs.append(pair)
        if serving:
            pair.wait_serving()
        return pair

    yield start
    for pair in pairs:
        pair.close()


@pytest.fixture(scope="module")
def reference(pp_llm, random_model):
    return pp_llm(model=random_model, enable_chunked_prefill=False, max_num_batched_tokens=128).generate(
        prompt_token_ids=prompts(), sampling_params=SAMPLING)


def test_two_hosts_match_one_device_then_drain_on_sigterm(start_pair, reference):
    pair = start_pair()
    # each stage binds and publishes its own host's address, whoever started it
    ready = {int(m[0]): (m[2], m[3]) for m in READY.findall(pair.log())}
    assert ready == {s: (expected_addresses(s).advertise,) * 2 for s in (0, 1)}, pair.log()
    want = expected_addresses(1)
    assert f"for the head at {want.control}, advertising {want.advertise}" in pair.log("stage")

    # every prompt twice, all at once: the 120-token prompt's chunks share steps with the others' decodes
    requests = [{"prompt": p, "sampling": _sampling(s)} for p, s in zip(prompts(), SAMPLING, strict=True)] * 2
    got = results(pair.client(requests))
    for out, ref in zip(got, [*reference, *reference], strict=True):
        assert "code" not in out, out
        assert out["token_ids"] == ref.token_ids and out["finish_reason"] == "length"

    # SIGTERM while a stream is in flight: it completes, then both hosts exit 0
    long = {**_sampling(GREEDY), "max_tokens": 64}
    client = pair.client([{"prompt": prompts()[1], "sampling": long, "wait": True}])
    started(client)
    pair.head.send_signal(signal.SIGTERM)
    [out] = results(client)
    assert len(out["token_ids"]) == 64 and out["finish_reason"] == "length", out
    assert pair.head.wait(timeout=60) == 0, pair.log()
    assert pair.stage.wait(timeout=30) == 0, pair.log("stage")
    assert wait_gone([pair.stage0], 10) == []
    print(f"SIGTERM: the stream in flight finished ({len(out['token_ids'])} tokens, {out['finish_reason']}); "
          f"head and remote stage exited 0")


def test_killed_remote_stage_ends_streams_unavailable_and_serve_promptly(start_pair):
    pair = start_pair()
    client = pair.client([{"prompt": p, "sampling": {**_sampling(GREEDY), "max_tokens": 200}, "wait": True}
                          for p in prompts()[:2]])
    started(client)
    killed = time.monotonic()
    os.kill(pair.stage.pid, signal.SIGKILL)
    took = exit_time(pair.head, killed, 30)
    # The control connection's EOF ends it at once (about 0.1 s idle); jax's coordination service would
    # notice only after its heartbeat timeout. The bound tells the two apart on a loaded machine.
    assert pair.head.returncode != 0 and took < 10.0, (pair.head.returncode, took, pair.log())
    streams = results(client)
    for out in streams:
        assert out.get("code") == "UNAVAILABLE" and "stage 1" in out["message"], out
        assert STAGE_IP in out["message"], out["message"]  # names the host it ran on
        assert out["ended"] - killed < 10.0, out["ended"] - killed  # the same bound: EOF, not a heartbeat
    assert wait_gone([pair.stage0], 10) == []
    print(f"after the remote stage's SIGKILL: streams ended in {[round(o['ended'] - killed, 3) for o in streams]} s "
          f"({streams[0]['code']}: {streams[0]['message']}); serve exited {pair.head.returncode} in {took:.3f} s")


def test_head_death_ends_the_remote_stage(start_pair):
    pair = start_pair()
    pair.head.kill()
    killed = time.monotonic()
    took = exit_time(pair.stage, killed, 30)
    assert pair.stage.returncode != 0, "a stage whose head died did not exit cleanly by itself"
    assert wait_gone([pair.stage0], 10) == []
    print(f"remote stage exited {took:.2f}s after the head's SIGKILL, code {pair.stage.returncode}")


def test_a_host_advertising_loopback_is_refused_in_one_line(start_pair):
    """A host that would publish 127.0.0.1 (the failure this guards against: a transfer server bound to
    loopback aborts jax's transport on the first hop) is stopped before it loads, in one line on the head."""
    pair = start_pair(("--advertise-address", "127.0.0.1"), serving=False)
    assert pair.head.wait(timeout=START_TIMEOUT_S) == 1
    last = pair.log().strip().splitlines()[-1]
    print(last)
    assert re.fullmatch(r"jaxcpp serve: error: stage 1 \(pid \d+ on \S+ at 127\.0\.0\.1\): start-up failed: "
                        rf"cannot reach the jax\.distributed coordinator at {re.escape(COORDINATOR)} from "
                        r"127\.0\.0\.1: Invalid argument \(127\.0\.0\.1 is a loopback address.*--advertise-address\)",
                        last), last
    assert pair.stage.wait(timeout=30) == 1
    deadline = time.monotonic() + 10
    while pair.hosts.pids("a") and time.monotonic() < deadline:  # the head's stage 0 too
        time.sleep(0.1)
    assert pair.hosts.pids("a") == []
