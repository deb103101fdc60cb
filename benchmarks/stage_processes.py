"""Stage processes measured: pipeline speed-up, calibration from real timings, TTFT by chunking policy,
host cost per micro-batch. One script, each part in its own subprocess (so each pins its own cores).

    nice -n 0 .venv/bin/python benchmarks/stage_processes.py [--prompt-len 4096] [--budget 1024] [--reps 3]

Model: a random Llama, hidden 256, 8 layers, 8 query heads / 2 KV heads (GQA), float32, written once to
a temporary folder. Every stage process is pinned to its own core with single-threaded XLA:CPU
(JAXCPP_PIN_STAGE_CORES=1); the one-process baseline pins itself to one core the same way.

    speedup    prefill throughput of two concurrent prompts (max_tokens 1): one process on one core vs
               PP 2 stage processes, fixed chunks at the budget, and PP 2 with dynamic chunking (`optimal`,
               calibrated first as in ttft)
    ttft       a lone prompt, median of --reps: fixed chunks at budget, budget/2, budget/4 (engines with
               that --max-num-batched-tokens), then on one dynamic-chunking engine (calibrated from the
               stage processes' runtime timings; the log lines are printed) equal-latency and optimal;
               each beside `predicted_ttft` of the chunks the engine really scheduled, from the installed model
    hostcost   a small model (hidden 64, 8 layers, 64-token steps): head submit -> stage received, where
               the stage was already waiting (control channel), and max(producer done, consumer's pull
               start) -> consumer inputs ready (activation hop: await_pull + pull), at P = 2, 4 and 8
               (--hostcost-pp)
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

PIN_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def write_model(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int) -> str:
    import jax

    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params

    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=max_len, eos_token_ids=(1,),
                         bos_token_id=0)
    save_hf(folder, init_params(config, jax.random.key(0)), config)
    return str(folder)


def engine(model: str, **kw: object):  # type: ignore[no-untyped-def]
    from jaxcpp import LLM

    # No prefix cache: every repetition sends the same prompt and must prefill it from the start.
    return LLM(model=model, dtype="float32", log_stats_interval_s=0, enable_prefix_caching=False, **kw)


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(2, 1024, n)]


def ttft_of(llm, tokens: list[int]) -> float:  # type: ignore[no-untyped-def]
    from jaxcpp import SamplingParams

    out = llm.generate(prompt_token_ids=[tokens], sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    return float(out[0].metrics.ttft)


def record_chunks(llm) -> list[int]:  # type: ignore[no-untyped-def]
    seen: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording(**kwargs):  # type: ignore[no-untyped-def]
        out = schedule(**kwargs)
        seen.extend(c.num_tokens for c in out.chunks if c.start < len(c.seq.prompt_token_ids))
        return out

    llm.engine.scheduler.schedule = recording
    return seen


# ---- parts (each in its own process) ----------------------------------------------------------------
def part_speedup(args: argparse.Namespace) -> dict:
    kw: dict[str, object] = dict(max_model_len=args.prompt_len + 16, max_num_batched_tokens=args.budget,
                                 max_num_seqs=4)
    prompts = [prompt(args.prompt_len, s) for s in (1, 2)]
    from jaxcpp import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    if args.pp > 1:
        kw.update(pipeline_parallel_size=args.pp, distributed_executor_backend="mp")
    model = None
    if args.dynamic:
        llm, model = calibrated_engine(args, **kw)
        llm.engine.chunking.policy = "optimal"
    else:
        llm = engine(args.model, **kw)
    llm.generate(prompt_token_ids=[prompt(args.budget, 9)], sampling_params=params)  # untimed
    seen = record_chunks(llm)
    seconds = []
    for _ in range(args.reps):
        seen.clear()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds.append(time.perf_counter() - t0)
    llm.engine.close()
    s = statistics.median(seconds)
    return {"pp": args.pp, "seconds": seconds, "median_s": s, "tokens_per_s": 2 * args.prompt_len / s,
            "chunks": list(seen), "model": model.describe() if model else None}


def calibrated_engine(args: argparse.Namespace, **kw: object):  # type: ignore[no-untyped-def]
    """A PP stage-process engine with dynamic chunking, calibrated from its stages' runtime timings by sole
    prefills as long as the prompts measured (a fit of shorter ones would be extrapolated to them); the
    installed model, or None where calibration gave up (noisy timings). The log lines are printed."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("jaxcpp.chunking").setLevel(logging.INFO)
    llm = engine(args.model, enable_dynamic_chunking=True,
                 dynamic_chunking_min_chunk_size=max(64, args.budget // 8), **kw)
    ctl = llm.engine.chunking
    for i in range(12):  # sole prefills alternate base chunks budget and budget/4
        if ctl.state != "calibrating":
            break
        ttft_of(llm, prompt(args.prompt_len - 64 * i, 100 + i))
    print(f"controller state after calibration: {ctl.state}; model: {ctl.model.describe() if ctl.model else None}",
          flush=True)
    return llm, ctl.model


def part_ttft(args: argparse.Namespace) -> dict:
    from jaxcpp.chunking.makespan import predicted_ttft

    long = prompt(args.prompt_len, 3)
    base = dict(max_model_len=args.prompt_len + 16, max_num_seqs=4, pipeline_parallel_size=2,
                distributed_executor_backend="mp")
    rows = []
    dyn, model = calibrated_engine(args, max_num_batched_tokens=args.budget, trace_file=args.trace, **base)
    ctl = dyn.engine.chunking
    if model is None:  # gave up (noisy timings): the fixed-chunk rows are still measured
        dyn.engine.close()
        return {"state": str(ctl.state), "rows": rows + fixed_rows(args, base, long, None, None)}
    weights = ctl.settings.stage_weights
    for policy in ("equal-latency", "optimal"):
        ctl.policy = policy
        seen = record_chunks(dyn)
        times, chunks = [], []
        for _ in range(args.reps):
            seen.clear()
            first_step = dyn.engine.scheduler.num_steps
            times.append(ttft_of(dyn, long))
            chunks = list(seen)
        rows.append({"policy": policy, "chunks": chunks, "measured": times,
                     "predicted": predicted_ttft(model, chunks, 2, weights)})
        if policy == "equal-latency" and args.png:
            last = [t for t in dyn.engine.executor.timings() if t.step_id >= first_step]
            from jaxcpp.tools.plot import plot_measured_vs_predicted

            plot_measured_vs_predicted(last, model, chunks, 2, args.png, "lone prompt, equal-latency chunks, PP 2",
                                       weights)
    dyn.engine.close()
    rows += fixed_rows(args, base, long, model, weights)
    return {"state": str(ctl.state), "model": model.describe(), "rows": rows}


def fixed_rows(args, base, long, model, weights) -> list:  # type: ignore[no-untyped-def]
    from jaxcpp.chunking.makespan import predicted_ttft

    rows = []
    for div in (1, 2, 4):
        budget = args.budget // div
        llm = engine(args.model, max_num_batched_tokens=budget, **base)
        seen = record_chunks(llm)
        ttft_of(llm, prompt(budget, 7))
        times = []
        for _ in range(args.reps):
            seen.clear()
            times.append(ttft_of(llm, long))
        rows.append({"policy": f"fixed {budget}", "chunks": list(seen), "measured": times,
                     "predicted": predicted_ttft(model, list(seen), 2, weights) if model else None})
        llm.engine.close()
    return rows


def part_hostcost(args: argparse.Namespace) -> dict:
    from jaxcpp import SamplingParams

    out = {}
    for pp in (int(p) for p in args.hostcost_pp.split(",")):
        llm = engine(args.model, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                     pipeline_parallel_size=pp, distributed_executor_backend="mp")
        llm.generate(prompt_token_ids=[prompt(300, s) for s in range(4)],
                     sampling_params=SamplingParams(max_tokens=32, ignore_eos=True))
        probes = [p for p in llm.engine.executor.probes() if p["id"] > 2]
        by_id: dict[int, dict[int, dict]] = {}
        for p in probes:
            by_id.setdefault(p["id"], {})[p["stage"]] = p
        # only where the stage was already waiting when the head sent: otherwise it is queueing
        control = [p["received"] - p["submitted"] for p in probes if p["idle_since"] < p["submitted"]]
        hops = [m[s]["inputs_ready"] - max(m[s]["pull_start"], m[s - 1]["done"])
                for m in by_id.values() for s in range(1, pp) if s in m and s - 1 in m]
        out[pp] = {"control_us": statistics.median(control) * 1e6, "hop_us": statistics.median(hops) * 1e6,
                   "n": len(by_id), "n_control": len(control), "n_hops": len(hops)}
        llm.engine.close()
    return out


def run_part(name: str, args: argparse.Namespace, extra: list[str], pin_self: bool) -> dict:
    env = {**os.environ, "JAXCPP_PIN_STAGE_CORES": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if pin_self:
        env["XLA_FLAGS"] = PIN_FLAGS
    cmd = [sys.executable, __file__, "--part", name, "--model", args.model, "--prompt-len", str(args.prompt_len),
           "--budget", str(args.budget), "--reps", str(args.reps), "--hostcost-pp", args.hostcost_pp, *extra]
    for flag in ("trace", "png"):
        if getattr(args, flag, None):
            cmd += [f"--{flag}", str(Path(getattr(args, flag)).resolve())]
    pre = ["taskset", "-c", "0"] if pin_self else []
    res = subprocess.run(pre + cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    lines = res.stdout.strip().splitlines()
    for line in lines[:-1]:
        print("   ", line)
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true", help="(speedup part) dynamic chunking, `optimal`")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default="speedup,ttft,hostcost")
    parser.add_argument("--hostcost-pp", default="2,4,8", help="pipeline sizes of the host-cost part")
    parser.add_argument("--trace", default=None, help="Perfetto trace of the dynamic-chunking engine")
    parser.add_argument("--png", default=None, help="measured vs predicted timeline of one run")
    args = parser.parse_args()
    if args.part:
        result = {"speedup": part_speedup, "ttft": part_ttft, "hostcost": part_hostcost}[args.part](args)
        print(json.dumps(result), flush=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix="jaxcpp_stage_bench_"))
    only = args.only.split(",")
    print(f"# stage processes benchmark, {os.cpu_count()} cores, load {os.getloadavg()}")
    if "speedup" in only or "ttft" in only:
        args.model = write_model(tmp / "big", 256, 8, 8, 2, args.prompt_len + 64)
    if "speedup" in only:
        one = run_part("speedup", args, ["--pp", "1"], pin_self=True)
        two = run_part("speedup", args, ["--pp", "2"], pin_self=False)
        dyn = run_part("speedup", args, ["--pp", "2", "--dynamic"], pin_self=False)
        print(f"speedup: one process one core {one['tokens_per_s']:.0f} tok/s ({one['seconds']}); "
              f"PP 2 stage processes {two['tokens_per_s']:.0f} tok/s ({two['seconds']}) "
              f"x{two['tokens_per_s'] / one['tokens_per_s']:.2f}; PP 2 with dynamic chunking (optimal, model "
              f"{dyn['model']}) {dyn['tokens_per_s']:.0f} tok/s ({dyn['seconds']}, chunks {dyn['chunks']}) "
              f"x{dyn['tokens_per_s'] / one['tokens_per_s']:.2f}", flush=True)
    if "ttft" in only:
        res = run_part("ttft", args, [], pin_self=False)
        print(f"ttft (installed model: {res.get('model')}):")
        for r in res["rows"]:
            med = statistics.median(r["measured"])
            pred = (f"predicted {r['predicted']:.3f}s ({(med / r['predicted'] - 1) * 100:+.0f}%)"
                    if r["predicted"] else "no installed model to predict from")
            print(f"  {r['policy']:>14}: measured {med:.3f}s {[round(t, 3) for t in r['measured']]}, {pred}, "
                  f"chunks {r['chunks']}")
    if "hostcost" in only:
        args.model = write_model(tmp / "small", 64, 8, 4, 2, 1024)
        res = run_part("hostcost", args, [], pin_self=False)
        for pp, r in res.items():
            print(f"host cost P={pp}: control channel {r['control_us']:.0f} us, activation hop {r['hop_us']:.0f} us "
                  f"(medians over {r['n_control']} idle-stage receipts and {r['n_hops']} hops, {r['n']} micro-batches)")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
