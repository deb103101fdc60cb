"""The runtime at the scale it is built for, on the timed stand-in device (`--stand-in-latency`): every
stage process, hop, control message, the head, the scheduler and the chunk controller are the production
code; only each forward is a wall-clock wait of a known per-stage latency model.

    .venv/bin/python benchmarks/stand_in.py [--scale 0.5] [--reps 3] [--only lone,concurrency]
        [--pp 2,4,8] [--lens 131072,262144] [--png docs/img/stand_in_timeline.png]

Model: Kimi-K2.5-like per stage, a = 0.572 / (32768^2 + 18500 * 32768) s, b = 18500 a, c = 5 ms,
gamma = 1630 a, every term times --scale (the runs are shorter by that factor; ratios do not change).
Budget 32K, min chunk 4096, page size 64, no prefix cache. `--shape deepseek-v3`: instead the PP 4 stage
of a DeepSeek-V3-shaped model with γ and a counted from its FLOPs (benchmarks/simulate_mla_chunking.py:
a = 5.96e-10, b = 6.96e-6, c = 20 ms, γ = 4.88e-7 s, or γ = R·a with --gamma-over-a R), times --scale,
for every PP. `--gamma-zero` adds lone rows of the calibrated engine planning with the fit calibration
would install if it could not see γ (simulate_mla_chunking.gamma_zero_fit of the installed model).

    lone         for each PP: one engine with dynamic chunking, calibrated from its stage processes'
                 runtime timings (the log lines are printed), then lone prompts of each length under
                 equal-latency and optimal; engines with fixed 8K, 16K and 32K budgets. Each row: the
                 median measured TTFT of --reps, the planner's prediction for the chunks the engine
                 really scheduled (the installed model's makespan, and the true model's)
    concurrency  PP 4 (the first of --pp that is 4, else the largest): 2, 4 and 8 prompts of the first
                 length at once, mean TTFT per policy, beside the simulator's prediction (the engine's
                 scheduling and in-flight rules on the installed model)
With --png: the measured vs predicted stage timeline of one lone run (the first length, PP 4, optimal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET = 32768
PAGE = 64
FIXED = (8192, 16384, 32768)


def true_model(scale: float, shape: str = "kimi", gamma_over_a: float | None = None):  # type: ignore[no-untyped-def]
    from jaxcpp.chunking.latency_model import LatencyModel

    if shape == "deepseek-v3":  # the PP 4 stage of benchmarks/simulate_mla_chunking.py: γ, a from V3's FLOPs
        sys.path.insert(0, str(Path(__file__).parent))
        from simulate_mla_chunking import true_model as v3_stage

        return v3_stage(4, gamma_over_a).scaled(scale)
    a = 0.572 / (32768**2 + 18500 * 32768) * scale
    return LatencyModel(a=a, b=18500 * a, c=0.005 * scale, gamma=1630 * a)


def write_model(folder: Path, max_len: int) -> str:
    """A small config the head plans from (vocabulary, layers); the stand-in never loads its weights."""
    import jax

    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params

    config = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_len,
                         eos_token_ids=(1,), bos_token_id=0)
    save_hf(folder, init_params(config, jax.random.key(0)), config)
    return str(folder)


def engine(args: argparse.Namespace, pp: int, budget: int, concurrency: int = 1, **kw: object):  # type: ignore[no-untyped-def]
    from jaxcpp import LLM

    m = true_model(args.scale, args.shape, args.gamma_over_a)
    longest = max(args.lens)
    pages = concurrency * -(-(longest + 64) // PAGE) + 1
    return LLM(model=args.model, pipeline_parallel_size=pp, distributed_executor_backend="mp",
               stand_in_latency=f"{m.a},{m.b},{m.c},{m.gamma}", max_model_len=longest + 64,
               max_num_batched_tokens=budget, max_num_seqs=max(4, concurrency), page_size=PAGE, num_pages=pages,
               enable_prefix_caching=False, log_stats_interval_s=0, **kw)


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(2, 1000, n)]


def run_prompts(llm, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:  # type: ignore[no-untyped-def]
    """TTFT of each prompt (all sent at once) and the prompt chunks the engine scheduled for each."""
    from jaxcpp import SamplingParams

    seen: dict[str, list[int]] = {}
    schedule = llm.engine.scheduler.schedule

    def recording(**kwargs):  # type: ignore[no-untyped-def]
        out = schedule(**kwargs)
        for c in out.chunks:
            if c.start < len(c.seq.prompt_token_ids):
                seen.setdefault(c.seq.request_id, []).append(c.num_tokens)
        return out

    llm.engine.scheduler.schedule = recording
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        llm.engine.scheduler.schedule = schedule
    return [float(o.metrics.ttft) for o in outs], [seen[o.request_id] for o in outs]


def calibrate(llm, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    ctl = llm.engine.chunking
    for i in range(16):
        if ctl.state != "calibrating":
            break
        run_prompts(llm, [prompt(BUDGET * 2 + 4096 * i, 1000 + i)])
    print(f"    calibration: {ctl.state}; installed {ctl.describe_model()}; "
          f"true {true_model(args.scale, args.shape, args.gamma_over_a).describe()}", flush=True)
    if ctl.model is None:
        llm.engine.close()
        raise SystemExit(f"calibration did not install a model: {ctl.calibrator.rejections[-3:]}")
    return ctl.model


def lone_rows(args: argparse.Namespace, pp: int) -> list[dict]:
    true, rows = true_model(args.scale, args.shape, args.gamma_over_a), []
    dyn = engine(args, pp, BUDGET, enable_dynamic_chunking=True, dynamic_chunking_min_chunk_size=4096)
    model = calibrate(dyn, args)
    for policy in ("equal-latency", "optimal"):
        dyn.engine.chunking.policy = policy
        for n in args.lens:
            rows.append(measure(dyn, policy, n, pp, model, true, args))
            if args.png and pp == 4 and n == args.lens[0] and policy == "optimal":
                plot(dyn, rows[-1], model, pp, args)
    if args.gamma_zero:  # the same engine's planners fed what calibration installs when it cannot see γ
        sys.path.insert(0, str(Path(__file__).parent))
        from simulate_mla_chunking import gamma_zero_fit

        for policy in ("equal-latency", "optimal"):
            dyn.engine.chunking.policy = policy
            for n in args.lens:
                fit0 = gamma_zero_fit(model, n)
                dyn.engine.chunking.install(fit0)
                rows.append(measure(dyn, f"{policy} γ=0 fit", n, pp, fit0, true, args))
    dyn.engine.close()
    for budget in FIXED:
        llm = engine(args, pp, budget)
        for n in args.lens:
            rows.append(measure(llm, f"fixed {budget}", n, pp, model, true, args))
        llm.engine.close()
    return rows


def measure(llm, policy: str, n: int, pp: int, model, true, args) -> dict:  # type: ignore[no-untyped-def]
    from jaxcpp.chunking.makespan import predicted_ttft

    times, chunks = [], []
    for rep in range(args.reps):
        ttft, scheduled = run_prompts(llm, [prompt(n, rep)])
        times.append(ttft[0])
        chunks = scheduled[0]
    row = {"pp": pp, "len": n, "policy": policy, "measured": times, "median": statistics.median(times),
           "chunks": chunks, "predicted": predicted_ttft(model, chunks, pp),
           "predicted_true": predicted_ttft(true, chunks, pp)}
    print(f"    PP {pp} {n:>6} {policy:>14}: measured {row['median']:.3f} s {[round(t, 3) for t in times]}, "
          f"predicted {row['predicted']:.3f} s ({(row['median'] / row['predicted'] - 1) * 100:+.1f}%), true-model "
          f"{row['predicted_true']:.3f} s, {len(chunks)} chunks", flush=True)
    return row


def plot(llm, row: dict, model, pp: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from jaxcpp.tools.plot import plot_measured_vs_predicted

    executor = llm.engine.executor
    first = llm.engine.scheduler.num_steps
    run_prompts(llm, [prompt(row["len"], 99)])
    timings = [t for t in executor.timings() if t.step_id >= first]
    plot_measured_vs_predicted(timings, model, row["chunks"], pp, args.png,
                               f"stand-in device, {row['len']} tokens alone, optimal chunks, PP {pp} "
                               f"(times x{args.scale})")


def concurrency_rows(args: argparse.Namespace, pp: int) -> list[dict]:
    from jaxcpp.chunking.controller import DynamicChunkController
    from jaxcpp.chunking.planner import ChunkSettings
    from jaxcpp.core.buckets import token_buckets
    from jaxcpp.tools.simulator import FixedPolicy, Pipeline, SimRequest, simulate

    n, levels, rows = args.lens[0], (2, 4, 8), []
    dyn = engine(args, pp, BUDGET, concurrency=max(levels), enable_dynamic_chunking=True,
                 dynamic_chunking_min_chunk_size=4096)
    model = calibrate(dyn, args)
    settings = ChunkSettings(budget=BUDGET, min_chunk_size=4096, pipeline_parallel_size=pp,
                             allowed_sizes=tuple(token_buckets(BUDGET, PAGE)))
    pipe = Pipeline(model, pp, max_in_flight=pp + 1)

    def add(llm, policy: str, sizer_for_sim, budget: int) -> None:  # type: ignore[no-untyped-def]
        for k in levels:
            times = []
            for rep in range(args.reps):
                ttft, _ = run_prompts(llm, [prompt(n, 100 * k + rep * 10 + i) for i in range(k)])
                times.append(statistics.mean(ttft))
            sim = simulate(pipe, sizer_for_sim(), budget, [SimRequest(i, 0.0, n) for i in range(k)])
            rows.append({"pp": pp, "concurrency": k, "policy": policy, "measured": times,
                         "median": statistics.median(times), "predicted": sim.mean_ttft})
            print(f"    PP {pp} x{k} {policy:>14}: mean TTFT {rows[-1]['median']:.3f} s "
                  f"{[round(t, 3) for t in times]}, predicted {sim.mean_ttft:.3f} s", flush=True)

    for policy in ("equal-latency", "optimal"):
        dyn.engine.chunking.policy = policy
        add(dyn, policy, lambda p=policy: DynamicChunkController(settings, policy=p, model=model), BUDGET)
    dyn.engine.close()
    for budget in FIXED:
        llm = engine(args, pp, budget, concurrency=max(levels))
        add(llm, f"fixed {budget}", lambda b=budget: FixedPolicy(b), budget)
        llm.engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--shape", choices=("kimi", "deepseek-v3"), default="kimi",
                        help="the stand-in's model: Kimi-K2.5-like (above) or DeepSeek-V3's PP 4 stage with γ and a "
                             "from its FLOPs (benchmarks/simulate_mla_chunking.py)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gamma-over-a", type=float, default=None, help="with --shape deepseek-v3: γ = this x a")
    parser.add_argument("--gamma-zero", action="store_true", help="also run the calibrated engine's planners "
                        "on the fit calibration would install without the L column (γ = 0)")
    parser.add_argument("--pp", default="2,4,8")
    parser.add_argument("--lens", default="131072,262144")
    parser.add_argument("--only", default="lone,concurrency")
    parser.add_argument("--png", default=None)
    parser.add_argument("--out", default=None, help="write every row as JSON here")  # a part: its rows
    args = parser.parse_args()
    args.lens = [int(n) for n in args.lens.split(",")]
    pps = [int(p) for p in args.pp.split(",")]
    if args.part:  # one PP in its own process (each engine's stage processes, the head's imports)
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("jaxcpp.chunking").setLevel(logging.INFO)
        rows = {"lone": lone_rows, "concurrency": concurrency_rows}[args.part](args, pps[0])
        Path(args.out).write_text(json.dumps(rows))
        return
    print(f"# stand-in device benchmark: {os.cpu_count()} cores, load {os.getloadavg()}, times x{args.scale}, "
          f"true model {true_model(args.scale, args.shape, args.gamma_over_a).describe()}", flush=True)
    args.model = write_model(Path(tempfile.mkdtemp(prefix="jaxcpp_stand_in_")), max(args.lens) + 64)
    results: dict[str, list[dict]] = {}
    rows_file = Path(tempfile.mkdtemp(prefix="jaxcpp_stand_in_rows_")) / "rows.json"
    for part in args.only.split(","):
        for pp in pps if part == "lone" else [4 if 4 in pps else max(pps)]:
            start = time.perf_counter()
            cmd = [sys.executable, __file__, "--part", part, "--model", args.model, "--scale", str(args.scale),
                   "--shape", args.shape, *(["--gamma-zero"] if args.gamma_zero else []),
                   *(["--gamma-over-a", str(args.gamma_over_a)] if args.gamma_over_a else []),
                   "--reps", str(args.reps), "--pp", str(pp), "--lens", ",".join(map(str, args.lens)),
                   "--out", str(rows_file)]
            if args.png:
                cmd += ["--png", str(Path(args.png).resolve())]
            print(f"## {part}, PP {pp}", flush=True)
            subprocess.run(cmd, check=True)
            results.setdefault(part, []).extend(json.loads(rows_file.read_text()))
            print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"load after: {os.getloadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
