"""One OS process per stage (`--distributed-executor-backend mp`): the same tokens and logits as one device,
nothing compiled after warm-up in any stage process, a killed stage noticed within 2 s, no orphans when
the head dies, and the multi-host path (a stage started on its own with --process-id, the coordinator on
loopback). Small random models and short prompts: each engine here is a few processes that compile.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxcpp import LLM, SamplingParams
from jaxcpp.core.executor import ExecutorError
from jaxcpp.head.mp_executor import MultiProcessExecutor
from jaxcpp.head.supervision import free_port
from tests.pipeline.conftest import child_pids
from tests.pipeline.test_pipeline_exactness import assert_same, prompts, run

pytestmark = pytest.mark.slow

MP = dict(distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def reference(pp_llm, random_model):
    return run(pp_llm(model=random_model, enable_chunked_prefill=False, max_num_batched_tokens=128))


@pytest.fixture(scope="module")
def mp_llm(make_pp_llm):
    """One multi-process engine per configuration for this module, closed (stages stopped) at the end."""
    engines: dict[tuple, LLM] = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in engines:
            engines[key] = make_pp_llm(**MP, **kwargs)
        return engines[key]

    yield get
    for llm in engines.values():
        llm.engine.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(("pp", "tp", "partition"), [
    (2, 1, None),
    (4, 1, None),      # 6 layers: 1,1,2,2
    (2, 2, None),      # two CPU devices in each stage process
    (3, 1, "1,3,2"),   # an uneven partition
])
def test_stage_processes_match_single_device(mp_llm, random_model, reference, pp, tp, partition):
    llm = mp_llm(model=random_model, pipeline_parallel_size=pp, tensor_parallel_size=tp, pp_partition=partition)
    executor = llm.engine.executor
    assert isinstance(executor, MultiProcessExecutor) and executor.max_in_flight == pp
    assert len(set(executor.stage_pids())) == pp and os.getpid() not in executor.stage_pids()
    outs = run(llm)  # chunked prefill (64-token budget) with decodes of the short prompts beside it
    assert_same(outs, reference)
    assert llm.engine.stats().num_compilations_since_warmup == 0, "a stage process compiled after warm-up"
    assert executor.num_compilations() > 0, "each stage reports its own compile count"


def test_fed_back_tokens_do_not_serialize_the_stages(mp_llm, random_model):
    """Two groups of sequences take turns (two at a time), so with async scheduling step k + 2 feeds
    back from step k. The last stage offers step k's tokens as soon as it samples them, so the first
    stage starts step j before the last has finished step j - 1 (had it offered them only on reading
    step j's header, after step j - 1, the two stages would take turns)."""
    llm = mp_llm(model=random_model, pipeline_parallel_size=2, max_num_seqs=2)
    executor = llm.engine.executor
    first_step = llm.engine.scheduler.num_steps
    llm.generate(prompt_token_ids=[[3 + i] * 8 for i in range(4)],
                 sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))
    probes = [p for p in executor.probes() if p["id"] >= first_step]
    ready = {p["id"]: p["inputs_ready"] for p in probes if p["stage"] == 0}
    last_done = {p["id"]: p["done"] for p in probes if p["stage"] == 1}
    overlapped = [j for j in ready if j - 1 in last_done and ready[j] < last_done[j - 1]]
    assert len(overlapped) >= len(ready) // 4, (len(overlapped), len(ready))
    assert llm.engine.stats().num_pages_used == 0


def test_dynamic_chunking_on_stage_processes(mp_llm, random_model, reference):
    """The start-up sweep runs on the stage processes (attention-free forwards timed there); chunks
    sized by the controller change nothing in the result."""
    llm = mp_llm(model=random_model, pipeline_parallel_size=2, max_num_batched_tokens=128,
                 enable_dynamic_chunking=True, dynamic_chunking_min_chunk_size=64,
                 dynamic_chunking_smooth_factor=1.0)
    assert llm.engine.chunking.stats()["state"] != "off"
    assert_same(run(llm), reference)
    assert llm.engine.stats().num_compilations_since_warmup == 0
    timings = llm.engine.executor.timings()
    assert timings and all(t.forward >= 0 for t in timings), "each stage timed its own forwards"


def test_killed_stage_fails_requests_within_2s(make_pp_llm, random_model):
    llm = make_pp_llm(model=random_model, pipeline_parallel_size=2, **MP)
    engine, executor = llm.engine, llm.engine.executor
    try:
        engine.add_request("r", prompts()[2], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        seq = engine.scheduler.requests["r"]
        for _ in range(4):
            engine.step()
        victim = executor.stage_pids()[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(ExecutorError) as err:
            while time.monotonic() - killed < 10:
                engine.step()
        noticed = time.monotonic() - killed
        assert noticed < 2.0, f"the head took {noticed:.2f}s to notice"
        assert err.value.stage == 1 and err.value.fatal
        assert "SIGKILL" in str(err.value) and str(victim) in str(err.value), str(err.value)
        assert seq.is_finished and seq.finish_reason == "error", "the request in flight failed with the stage"
    finally:
        engine.close()
    assert wait_gone([p for p in executor.stage_pids() if p], 10) == []


SIZED_HEAD = textwrap.dedent("""
    import json, sys
    from jaxcpp import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="auto", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
              kv_cache_memory_gb=float(sys.argv[2]), log_stats_interval_s=0, pipeline_parallel_size=2,
              distributed_executor_backend="mp")
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    sizing = llm.engine.sizing
    print(json.dumps({"head": [sizing.spec.config.dtype, sizing.num_pages],
                      "stages": [list(ln.sized) for ln in llm.engine.executor.links],
                      "tokens": len(out[0].token_ids),
                      "jax": sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))}))
    llm.engine.close()
""")


def test_the_head_sizes_the_stages_and_holds_no_jax(tmp_path):
    """A bfloat16 checkpoint with --dtype auto, stages on the CPU backend: the head resolves auto on the
    stages' backend (float32), sizes the KV pages for it, and every stage builds exactly that (a stage
    that sized itself read auto as bfloat16 and held twice the pages). The head process never imports
    jax, so it holds no backend (on a GPU host one would reserve device memory)."""
    import jax
    import jax.numpy as jnp

    from jaxcpp.models.checkpoint import save_orbax
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_ids=(1,), dtype="bfloat16")
    save_orbax(tmp_path, init_params(config, jax.random.key(0), jnp.bfloat16), config)
    page_bytes_f32 = 2 * 3 * 16 * 2 * 16 * 4  # K and V, 3 layers a stage, 16 tokens, 2 heads of 16, float32
    memory_gb = 40.5 * page_bytes_f32 / 2**30  # 40 float32 pages (81 in bfloat16), under the cap of 8 x 16 + 1
    out = subprocess.run([sys.executable, "-c", SIZED_HEAD, str(tmp_path), repr(memory_gb)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["head"] == ["float32", 40]
    assert report["stages"] == [["float32", 40], ["float32", 40]]
    assert report["tokens"] == 4
    assert report["jax"] == [], "the multi-process head imported jax"


HEAD = textwrap.dedent("""
    import sys, time
    from jaxcpp import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=8, log_stats_interval_s=0, pipeline_parallel_size=2,
              distributed_executor_backend="mp")
    print("PIDS", *llm.engine.executor.stage_pids(), flush=True)
    time.sleep(600)
""")


def test_no_orphans_when_the_head_dies(random_model):
    head = subprocess.Popen([sys.executable, "-c", HEAD, random_model], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        for line in head.stdout:  # type: ignore[union-attr]
            if line.startswith("PIDS"):
                break
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        head.kill()
        head.wait()
    assert wait_gone(pids, 5) == [], "stage processes outlived their head"


def test_multi_host_path_on_loopback(make_pp_llm, random_model, reference, monkeypatch):
    """As on separate hosts: stage 1 is started by hand (`jaxcpp serve --process-id 1`), the head is
    process 0 and spawns its own stage 0, which hosts the jax.distributed coordinator. (On real
    interfaces: test_multi_host.py.)"""
    port = free_port()
    while port + 1 > 65535 or not _free(port + 1):
        port = free_port()
    coordinator = f"127.0.0.1:{port}"
    monkeypatch.setenv("JAXCPP_CONTROL_KEY", secrets.token_hex(16))  # shared by the "hosts"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as on a host of its own
    worker = subprocess.Popen([sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", random_model,
                               "--pipeline-parallel-size", "2", "--num-processes", "2", "--process-id", "1",
                               "--coordinator-address", coordinator], env=env)
    try:
        llm = make_pp_llm(model=random_model, pipeline_parallel_size=2, num_processes=2, process_id=0,
                          coordinator_address=coordinator)
        assert isinstance(llm.engine.executor, MultiProcessExecutor)
        assert worker.pid in llm.engine.executor.stage_pids(), "stage 1 is the process started by hand"
        assert_same(run(llm), reference)
        llm.engine.close()
        assert worker.wait(timeout=30) == 0, "a stage stopped by its head exits 0"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_bad_distributed_flags_name_the_flag():
    from jaxcpp.config import ConfigError, ParallelConfig

    with pytest.raises(ConfigError, match="--num-processes"):
        ParallelConfig(pipeline_parallel_size=2, num_processes=3, process_id=0, coordinator_address="h:1")
    with pytest.raises(ConfigError, match="--process-id"):
        ParallelConfig(pipeline_parallel_size=2, num_processes=2, process_id=2, coordinator_address="h:1")
    with pytest.raises(ConfigError, match="--coordinator-address"):
        ParallelConfig(pipeline_parallel_size=2, num_processes=2, process_id=0, coordinator_address=None)
    with pytest.raises(ConfigError, match="--distributed-executor-backend"):
        ParallelConfig(pipeline_parallel_size=2, num_processes=2, process_id=0, coordinator_address="h:1",
                       distributed_executor_backend="inproc")


def test_lws_environment_fills_the_distributed_flags(monkeypatch):
    from jaxcpp.config import ParallelConfig

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "group-0.svc")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    monkeypatch.setenv("LWS_WORKER_INDEX", "3")
    p = ParallelConfig(pipeline_parallel_size=4)
    assert (p.coordinator_address, p.num_processes, p.process_id) == ("group-0.svc:8476", 4, 3)
    assert p.executor_backend == "mp" and p.is_multi_host
    monkeypatch.setenv("JAX_PROCESS_ID", "2")  # JAX's own variables win
    assert ParallelConfig(pipeline_parallel_size=4).process_id == 2


def _serve_mp(model: str, tmp_path) -> tuple[subprocess.Popen, str, list[int]]:
    """`jaxcpp serve` with two stage processes; its address and the stage pids (its children)."""
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--port", "0", "--http-port", "0",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "64",
           "--max-num-seqs", "8", "--log-stats-interval-s", "0", "--pipeline-parallel-size", "2",
           "--distributed-executor-backend", "mp", "--shutdown-grace-s", "5", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("jaxcpp: serving"), (line, log.read_text())
    return proc, line.split(" on ")[1].split()[0], child_pids(proc.pid)


def test_serve_exits_nonzero_when_a_stage_dies(random_model, tmp_path):
    import grpc

    from jaxcpp.serving import Client

    proc, target, stages = _serve_mp(random_model, tmp_path)
    try:
        assert len(stages) == 2
        with Client(target, timeout=60) as client:
            assert client.health() == "SERVING"
            assert client.generate([3, 4, 5], max_tokens=4, temperature=0).num_generated_tokens == 4
            os.kill(stages[1], signal.SIGKILL)  # idle: no step would see it; the executor tells the server
            deadline, health = time.monotonic() + 2, "SERVING"
            while time.monotonic() < deadline and health == "SERVING":
                try:
                    health = client.health()
                except grpc.RpcError:
                    health = "GONE"
                time.sleep(0.05)
            assert health != "SERVING", "health still SERVING 2 s after a stage died"
        assert proc.wait(timeout=60) == 1, "an orchestrator must see the failure and restart the group"
        assert wait_gone(stages, 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_sigterm_drains_then_stops_the_stages(random_model, tmp_path):
    proc, target, stages = _serve_mp(random_model, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(stages, 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
