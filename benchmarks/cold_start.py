"""Cold start of `jaxcpp serve`: time to SERVING from an empty and from a warm compilation cache.

    .venv/bin/python benchmarks/cold_start.py                      # bundled model, default serve flags
    .venv/bin/python benchmarks/cold_start.py --runs 3 --serve-args "--max-num-batched-tokens 2048"
    .venv/bin/python benchmarks/cold_start.py --baseline main      # + serve with main's ladder and attention
    .venv/bin/python benchmarks/cold_start.py --profile             # where the cold start goes, in-process
    .venv/bin/python benchmarks/cold_start.py --profile --concurrent-compile 2   # + 2 buckets at a time
    .venv/bin/python benchmarks/cold_start.py --profile --baseline main  # + the attention path at `main`

Default mode: each run starts `jaxcpp serve` with JAXCPP_COMPILATION_CACHE_DIR pointed at a fresh
temporary folder (cold), waits until the standard gRPC health service answers SERVING, stops it
(SIGTERM), then starts it again on the same folder (warm). It prints the time to SERVING, the warm-up
total and the per-program compile times the log reports ("compiled bucket i/N: T tokens (s)"), and the
medians over `--runs`. `--baseline REV` alternates with a `jaxcpp serve` whose bucket ladder
(jaxcpp/core/buckets.py) and XLA attention path (kernels/ragged_paged_attention.py) are those of git
revision REV, everything else current.

`--profile`: builds the engine in this process (what `serve` does before it listens) with JAX's
monitoring events attached, on a fresh cache, and splits the start-up into import, model load,
tracing (jaxpr), lowering (to StableHLO), XLA compile, and the rest (running the warm-up steps, cache
writes, host work). `--concurrent-compile N` also profiles the engine's warm-up compiling N buckets at
a time (JAXCPP_COMPILE_THREADS=N; the sequential run sets it to 1). `--baseline REV` also profiles a
start-up whose XLA attention path is the one of git revision REV (what a kernel change costs in compile
time).
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


def serve_with_baseline(revision: str, argv: list[str]) -> int:
    """`jaxcpp serve` with the bucket ladder and the XLA attention path of `revision` patched in."""
    sys.path.insert(0, str(Path(__file__).parent))
    from baseline import use_ladder_at
    from offline_throughput import use_attention_at

    from jaxcpp.serving.cli import main as jaxcpp_main

    use_attention_at(revision)
    use_ladder_at(revision)
    return jaxcpp_main(argv)


def start_to_serving(cache_dir: str, serve_args: list[str], timeout_s: float,
                     baseline: str | None = None) -> dict[str, object]:
    """Start `jaxcpp serve`, poll health until SERVING; return the timings and the log's compile lines."""
    port = free_port()
    env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": cache_dir}
    argv = ["serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0", *serve_args]
    cmd = [sys.executable, __file__, "--serve-child", baseline, *argv] if baseline else [JAXCPP, *argv]
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
    variants = {"current": None, **({f"@{args.baseline}": args.baseline} if args.baseline else {})}
    runs: dict[str, list] = {name: [] for name in variants}
    for i in range(args.runs):
        for variant, revision in variants.items():  # alternate, so load falls on both alike
            with tempfile.TemporaryDirectory(prefix="jaxcpp-cold-start-") as cache_dir:
                cold = start_to_serving(cache_dir, serve_args, args.timeout, revision)
                warm = start_to_serving(cache_dir, serve_args, args.timeout, revision)
            runs[variant].append({"cold": cold, "warm": warm})
            for name, r in (("cold", cold), ("warm", warm)):
                per_bucket = " ".join(f"{t}:{s:.1f}" for t, s in r["buckets"])
                print(f"{variant} run {i + 1} {name}: SERVING after {r['to_serving_s']:.1f}s, warm-up "
                      f"{r['warmup_s']}s, {len(r['buckets'])} programs (tokens:s) {per_bucket}", flush=True)
    summary: dict[str, dict] = {}
    print(f"\n{'variant':12} {'cache':6} {'programs':>8} {'median to SERVING s':>20} {'median warm-up s':>17}")
    for variant, vruns in runs.items():
        for name in ("cold", "warm"):
            s = {"to_serving_s": statistics.median(r[name]["to_serving_s"] for r in vruns),
                 "warmup_s": statistics.median(r[name]["warmup_s"] or 0.0 for r in vruns),
                 "programs": len(vruns[0][name]["buckets"])}
            summary[f"{variant} {name}"] = s
            print(f"{variant:12} {name:6} {s['programs']:8} {s['to_serving_s']:20.1f} {s['warmup_s']:17.1f}")
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


def profile_child(args: argparse.Namespace) -> None:
    """One in-process start-up on the (fresh) cache in JAXCPP_COMPILATION_CACHE_DIR; prints JSON."""
    t0 = time.perf_counter()
    import jax  # noqa: F401

    from jaxcpp.cli_args import add_engine_args, engine_config_from_args

    imported = time.perf_counter() - t0
    if args.baseline:
        sys.path.insert(0, str(Path(__file__).parent))
        from offline_throughput import use_attention_at

        use_attention_at(args.baseline)
    events = CompileEvents()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_config = engine_config_from_args(parser.parse_args(["--model", "tiny", *shlex.split(args.serve_args)]))
    from jaxcpp.core.engine import LLMEngine

    t1 = time.perf_counter()
    engine = LLMEngine(engine_config)
    build = time.perf_counter() - t1
    print(json.dumps({"import_s": imported, "engine_s": build,
                      "warmup_s": engine.warmup_seconds, "buckets": engine.sizing.shape.buckets,
                      "events_s": dict(events.seconds), "event_counts": dict(events.counts)}))


def run_profile_child(args: argparse.Namespace, concurrent: int, baseline: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="jaxcpp-cold-start-") as cache_dir:
        env = {**os.environ, "JAXCPP_COMPILATION_CACHE_DIR": cache_dir,
               "JAXCPP_COMPILE_THREADS": str(max(1, concurrent))}
        cmd = [sys.executable, __file__, "--profile-child", "--serve-args", args.serve_args,
               "--concurrent-compile", str(concurrent), *(["--baseline", baseline] if baseline else [])]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_profile(name: str, p: dict[str, object]) -> None:
    ev = p["events_s"]
    startup = p["import_s"] + p["engine_s"]
    phases = {"trace": ev.get("trace", 0.0), "lower": ev.get("lower", 0.0), "compile": ev.get("compile", 0.0),
              "cache read": ev.get("cache read", 0.0)}
    rest = startup - p["import_s"] - sum(phases.values())
    row = " ".join(f"{k} {v:.1f}s" for k, v in phases.items())
    print(f"{name}: start-up {startup:.1f}s = import {p['import_s']:.1f}s, {row}, rest {rest:.1f}s "
          f"(programs compiled: {p['event_counts'].get('compile', 0)}; engine {p['engine_s']:.1f}s of which "
          f"warm-up {p['warmup_s']:.1f}s)")


def run_profile_mode(args: argparse.Namespace) -> dict[str, object]:
    print(f"in-process engine start-up (what serve does before it listens), fresh cache, flags: "
          f"--model tiny {args.serve_args}")
    variants = {"sequential": (0, None)}
    if args.concurrent_compile:
        variants[f"concurrent x{args.concurrent_compile}"] = (args.concurrent_compile, None)
    if args.baseline:
        variants[f"sequential, attention@{args.baseline}"] = (0, args.baseline)
    results: dict[str, list] = {name: [] for name in variants}
    for _ in range(args.runs):  # alternate, so load on the machine falls on all alike
        for name, (concurrent, baseline) in variants.items():
            p = run_profile_child(args, concurrent, baseline)
            results[name].append(p)
            print_profile(name, p)
    print()
    for name, runs in results.items():
        total = statistics.median(r["import_s"] + r["engine_s"] for r in runs)
        print(f"median start-up, {name}: {total:.1f}s over {len(runs)} run(s)")
    return results


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-child":
        sys.exit(serve_with_baseline(sys.argv[2], sys.argv[3:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="cold/warm pairs (or profile runs); medians printed")
    p.add_argument("--serve-args", default="", help="extra flags for `jaxcpp serve` (default flags otherwise)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    p.add_argument("--profile", action="store_true", help="split an in-process cold start by phase")
    p.add_argument("--concurrent-compile", type=int, default=0, metavar="N",
                   help="with --profile: also time compiling the buckets in N threads first")
    p.add_argument("--baseline", metavar="REV",
                   help="also run with the bucket ladder and XLA attention path of git revision REV "
                        "(--profile: the attention path only)")
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
