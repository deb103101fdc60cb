"""Cold start of `jaxcpp serve`: time to SERVING from an empty and from a warm compilation cache.

    .venv/bin/python benchmarks/cold_start.py                      # bundled model, default serve flags
    .venv/bin/python benchmarks/cold_start.py --runs 3 --serve-args "--max-num-batched-tokens 2048"
    .venv/bin/python benchmarks/cold_start.py --profile             # where the cold start goes, in-process
    .venv/bin/python benchmarks/cold_start.py --profile --concurrent-compile 2   # + a concurrent prototype

Default mode: each run starts `jaxcpp serve` with JAXCPP_COMPILATION_CACHE_DIR pointed at a fresh
temporary folder (cold), waits until the standard gRPC health service answers SERVING, stops it
(SIGTERM), then starts it again on the same folder (warm). It prints the time to SERVING, the warm-up
total and the per-program compile times the log reports ("compiled bucket i/N: T tokens (s)"), and the
medians over `--runs`.

`--profile`: builds the engine in this process (what `serve` does before it listens) with JAX's
monitoring events attached, on a fresh cache, and splits the start-up into import, model load,
tracing (jaxpr), lowering (to StableHLO), XLA compile, and the rest (running the warm-up steps, cache
writes, host work). `--concurrent-compile N` also times a prototype that lowers and compiles every
bucket's program in N threads (`jax.jit(...).lower(...).compile()`, which fills the persistent cache)
before the engine's own warm-up, which then only reads the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

BUCKET_LINE = re.compile(r"compiled bucket (\d+)/(\d+)[^:]*: (\d+) tokens \(([\d.]+)s\)")
READY_LINE = re.compile(r"engine ready: .* compiled in ([\d.]+)s")
JAXCPP = str(Path(sys.executable).with_name("jaxcpp"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(target: str) -> str | None:
    """The health service's answer, or None while nothing listens yet."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def start_to_serving(cache_dir: str, serve_args: list[str], timeout_s: float) -> dict[str, object]:
    """Start `jaxcpp serve`, poll health until SERVING; return the timings and the log's compile lines."""
    port = free_port()
    env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": cache_dir}
    cmd = [JAXCPP, "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    log_lines: list[str] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: log_lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        while health_status(f"127.0.0.1:{port}") != "SERVING":
            if proc.poll() is not None:
                raise SystemExit(f"jaxcpp serve exited with {proc.returncode}:\n" + "".join(log_lines))
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"not SERVING after {timeout_s}s:\n" + "".join(log_lines))
            time.sleep(0.05)
        to_serving = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    text = "".join(log_lines)
    buckets = [(int(m[3]), float(m[4])) for m in BUCKET_LINE.finditer(text)]
    ready = READY_LINE.search(text)
    return {"to_serving_s": to_serving, "warmup_s": float(ready[1]) if ready else None, "buckets": buckets,
            "exit_code": proc.returncode}


def run_serve_mode(args: argparse.Namespace) -> dict[str, object]:
    serve_args = shlex.split(args.serve_args)
    print(f"jaxcpp serve --model tiny {args.serve_args} (the rest default); {args.runs} cold/warm pair(s)")
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="jaxcpp-cold-start-") as cache_dir:
            cold = start_to_serving(cache_dir, serve_args, args.timeout)
            warm = start_to_serving(cache_dir, serve_args, args.timeout)
        runs.append({"cold": cold, "warm": warm})
        for name, r in (("cold", cold), ("warm", warm)):
            per_bucket = " ".join(f"{t}:{s:.1f}" for t, s in r["buckets"])
            print(f"run {i + 1} {name}: SERVING after {r['to_serving_s']:.1f}s, warm-up {r['warmup_s']}s, "
                  f"{len(r['buckets'])} programs (tokens:s) {per_bucket}")
    summary = {}
    for name in ("cold", "warm"):
        summary[name] = {"to_serving_s": statistics.median(r[name]["to_serving_s"] for r in runs),
                         "warmup_s": statistics.median(r[name]["warmup_s"] or 0.0 for r in runs)}
    print(f"\n{'cache':6} {'median to SERVING s':>20} {'median warm-up s':>17}")
    for name, s in summary.items():
        print(f"{name:6} {s['to_serving_s']:20.1f} {s['warmup_s']:17.1f}")
    return {"runs": runs, "median": summary}


# ------------------------------------------------------------------------------------------ --profile


class CompileEvents:
    """Sums JAX's compile-phase duration events (trace, lower, compile, cache) as they fire."""

    NAMES = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
        "/jax/compilation_cache/cache_retrieval_time_sec": "cache read",
    }

    def __init__(self) -> None:
        import jax

        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, **_: object) -> None:
        name = self.NAMES.get(event)
        if name is not None:
            self.seconds[name] += seconds
            self.counts[name] += 1


def precompile_concurrently(engine_config, loaded, threads: int) -> float:
    """Prototype: lower + compile every bucket's step program in `threads` threads; returns seconds.

    Mirrors ModelRunner's jitted step (same function, same donation), so the programs land in the
    persistent cache under the keys the warm-up then looks up."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    from jaxcpp.kernels.backend import select_attention
    from jaxcpp.runtime.model_runner import ModelRunner, dummy_step

    runner = ModelRunner(loaded.config, loaded.params, loaded.num_pages, engine_config.cache.block_size,
                         select_attention(engine_config.model.attention_backend))

    def compile_bucket(num_tokens: int) -> float:
        t0 = time.perf_counter()
        step = dummy_step(num_tokens, engine_config.scheduler.max_num_seqs, loaded.pages_per_seq)
        runner._step.lower(runner.params, runner.kv, dict(step.__dict__)).compile()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(compile_bucket, loaded.token_buckets))
    seconds = time.perf_counter() - t0
    jax.clear_caches()  # the warm-up must find the programs in the persistent cache, not in memory
    return seconds


def profile_child(args: argparse.Namespace) -> None:
    """One in-process start-up on the (fresh) cache in JAXCPP_COMPILATION_CACHE_DIR; prints JSON."""
    t0 = time.perf_counter()
    import jax  # noqa: F401

    from jaxcpp.cli_args import add_engine_args, engine_config_from_args

    imported = time.perf_counter() - t0
    events = CompileEvents()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_config = engine_config_from_args(parser.parse_args(["--model", "tiny", *shlex.split(args.serve_args)]))
    precompile_s = 0.0
    if args.concurrent_compile:
        from jaxcpp.runtime.factory import load_model

        precompile_s = precompile_concurrently(engine_config, load_model(engine_config), args.concurrent_compile)
    from jaxcpp.engine import LLMEngine

    t1 = time.perf_counter()
    engine = LLMEngine(engine_config)
    build = time.perf_counter() - t1
    print(json.dumps({"import_s": imported, "precompile_s": precompile_s, "engine_s": build,
                      "warmup_s": engine.warmup_seconds, "buckets": engine.shape.token_buckets,
                      "events_s": dict(events.seconds), "event_counts": dict(events.counts)}))


def run_profile_child(args: argparse.Namespace, concurrent: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="jaxcpp-cold-start-") as cache_dir:
        env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": cache_dir}
        cmd = [sys.executable, __file__, "--profile-child", "--serve-args", args.serve_args,
               "--concurrent-compile", str(concurrent)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_profile(name: str, p: dict[str, object]) -> None:
    ev = p["events_s"]
    startup = p["import_s"] + p["precompile_s"] + p["engine_s"]
    phases = {"trace": ev.get("trace", 0.0), "lower": ev.get("lower", 0.0), "compile": ev.get("compile", 0.0),
              "cache read": ev.get("cache read", 0.0)}
    rest = startup - p["import_s"] - sum(phases.values())
    row = " ".join(f"{k} {v:.1f}s" for k, v in phases.items())
    print(f"{name}: start-up {startup:.1f}s = import {p['import_s']:.1f}s, {row}, rest {rest:.1f}s "
          f"(programs compiled: {p['event_counts'].get('compile', 0)}; concurrent precompile "
          f"{p['precompile_s']:.1f}s, engine {p['engine_s']:.1f}s of which warm-up {p['warmup_s']:.1f}s)")


def run_profile_mode(args: argparse.Namespace) -> dict[str, object]:
    print(f"in-process engine start-up (what serve does before it listens), fresh cache, flags: "
          f"--model tiny {args.serve_args}")
    results: dict[str, list] = {"sequential": []}
    if args.concurrent_compile:
        results[f"concurrent x{args.concurrent_compile}"] = []
    for _ in range(args.runs):  # alternate, so load on the machine falls on both alike
        for name in results:
            p = run_profile_child(args, 0 if name == "sequential" else args.concurrent_compile)
            results[name].append(p)
            print_profile(name, p)
    print()
    for name, runs in results.items():
        total = statistics.median(r["import_s"] + r["precompile_s"] + r["engine_s"] for r in runs)
        print(f"median start-up, {name}: {total:.1f}s over {len(runs)} run(s)")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="cold/warm pairs (or profile runs); medians printed")
    p.add_argument("--serve-args", default="", help="extra flags for `jaxcpp serve` (default flags otherwise)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    p.add_argument("--profile", action="store_true", help="split an in-process cold start by phase")
    p.add_argument("--concurrent-compile", type=int, default=0, metavar="N",
                   help="with --profile: also time compiling the buckets in N threads first")
    p.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.profile_child:
        profile_child(args)
        return
    results = run_profile_mode(args) if args.profile else run_serve_mode(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
