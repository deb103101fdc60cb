"""Stage processes measured: pipeline speed-up, calibration from real timings, TTFT by chunking policy,
host cost per micro-batch. One script, each part in its own subprocess (so each pins its own cores).

    nice -n 0 .venv/bin/python benchmarks/stage_processes.py [--prompt-len 4096] [--budget 1024] [--reps 3]

Model: a random Llama, hidden 256, 8 layers, 8 query heads / 2 KV heads (GQA), float32, written once to
a temporary folder. Every stage process is pinned to its own core with single-threaded XLA:CPU
(JAXCPP_PIN_STAGE_CORES=1); the one-process baseline pins itself to one core the same way.

    speedup    prefill throughput of two concurrent prompts (max_tokens 1): one process on one core vs
               PP 2 stage processes, fixed chunks at the budget, and PP 2 with dynamic chunking (`optimal`,
               calibrated first as in ttft); the three kept running and alternated, --reps rounds, the
               speed-up the median of each round's ratio
    ttft       a lone prompt, median of --reps: fixed chunks at budget, budget/2, budget/4 (engines with
               that --max-num-batched-tokens), and on one dynamic-chunking engine (calibrated from the
               stage processes' runtime timings; the log lines are printed) equal-latency, optimal
               (trusting the fit to its error) and optimal with the fit taken as exact, the six
               alternated round by round; each beside `predicted_ttft` of the chunks the engine really
               scheduled, from the installed model
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


def rotated(items: list, r: int) -> list:
    """Round r's order: the list rotated by r, so no configuration always runs first."""
    return items[r % len(items):] + items[:r % len(items)]


# ---- parts (each in its own process) ----------------------------------------------------------------
def part_speedup(args: argparse.Namespace) -> None:
    """One configuration of the speed-up, kept running: one timed repetition per line read from stdin
    (the parent alternates configurations, so a machine whose speed drifts slows them all alike)."""
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
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # untimed: a full run warms every path
    seen = record_chunks(llm)
    print(json.dumps({"ready": True, "model": llm.engine.chunking.describe_model() if model else None}), flush=True)
    for _ in sys.stdin:
        seen.clear()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        print(json.dumps({"seconds": time.perf_counter() - t0, "chunks": list(seen)}), flush=True)
    llm.engine.close()


class SpeedupConfig:
    """A speed-up configuration's process (`part_speedup`), started once, asked for one repetition at a time."""

    def __init__(self, name: str, args: argparse.Namespace, extra: list[str], pin_self: bool) -> None:
        self.name, self.seconds, self.chunks = name, [], []
        self.proc = start_part("speedup", args, extra, pin_self, stdin=subprocess.PIPE)
        self.model = self._reply()["model"]

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
            print("   ", line.rstrip())
        raise RuntimeError(f"the {self.name} configuration's process ended (exit {self.proc.wait()})")

    def run_once(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self.seconds.append(reply["seconds"])
        self.chunks = reply["chunks"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def speedup(args: argparse.Namespace) -> None:
    """The three configurations started one after another (their start-ups do not overlap), then --reps
    rounds, each running every configuration once, in an order rotated round by round; the speed-ups are
    medians of each round's ratios."""
    configs = [SpeedupConfig("one process, one core", args, ["--pp", "1"], pin_self=True),
               SpeedupConfig("PP 2, fixed chunks", args, ["--pp", "2"], pin_self=False),
               SpeedupConfig("PP 2, dynamic chunking (optimal)", args, ["--pp", "2", "--dynamic"], pin_self=False)]
    for r in range(args.reps):
        for c in rotated(configs, r):
            c.run_once()
    for c in configs:
        c.close()
    one = configs[0]
    print(f"speedup ({args.reps} alternating rounds; model of the dynamic configuration: {configs[2].model}):")
    for c in configs:
        ratios = [a / b for a, b in zip(one.seconds, c.seconds, strict=True)]
        print(f"  {c.name:>34}: median {c.median_s:.3f} s ({2 * args.prompt_len / c.median_s:.0f} tok/s) "
              f"{[round(t, 3) for t in c.seconds]}; x{statistics.median(ratios):.2f} median of rounds "
              f"{[round(x, 2) for x in ratios]}; chunks {c.chunks}", flush=True)


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
    print(f"controller state after calibration: {ctl.state}; model: {ctl.describe_model()}",
          flush=True)
    return llm, ctl.model


EXACT_FIT = "optimal, exact fit"


def part_ttft(args: argparse.Namespace) -> dict:
    """The policies on four engines alive at once (an idle engine's processes take no CPU), warmed by a
    full untimed run each, then --reps rounds running each policy once, in an order rotated round by
    round, so a machine whose speed drifts slows them all alike. "optimal" is the engine's (trusting the
    fit to its error); "optimal, exact fit" the same engine with the fit error set to 0."""
    from jaxcpp.chunking.makespan import predicted_ttft

    long = prompt(args.prompt_len, 3)
    base = dict(max_model_len=args.prompt_len + 16, max_num_seqs=4, pipeline_parallel_size=2,
                distributed_executor_backend="mp")
    dyn, model = calibrated_engine(args, max_num_batched_tokens=args.budget, trace_file=args.trace, **base)
    ctl = dyn.engine.chunking
    engines = {f"fixed {args.budget // d}": engine(args.model, max_num_batched_tokens=args.budget // d, **base)
               for d in (1, 2, 4)}
    fit_error = ctl.fit_error
    policies = list(engines) if model is None else ["equal-latency", "optimal", EXACT_FIT, *engines]
    rows = {p: {"policy": p, "measured": [], "chunks": [], "over_flow_shop": []} for p in policies}
    seen = {id(llm): record_chunks(llm) for llm in (dyn, *engines.values())}
    png_steps = None
    for r in range(args.reps + 1):  # round 0 is the untimed warm-up
        for p in rotated(policies, r):
            llm = engines.get(p, dyn)
            if p not in engines:
                ctl.policy = "optimal" if p == EXACT_FIT else p
                ctl.fit_error = 0.0 if p == EXACT_FIT else fit_error
            chunks = seen[id(llm)]
            chunks.clear()
            first_step = llm.engine.scheduler.num_steps
            ttft = ttft_of(llm, long)
            if r:
                rows[p]["measured"].append(ttft)
                rows[p]["chunks"] = list(chunks)
                rows[p]["over_flow_shop"].append(over_flow_shop(llm, first_step))
            if r == 1 and p == "equal-latency":
                png_steps = (first_step, llm.engine.scheduler.num_steps, list(chunks))
    weights = ctl.settings.stage_weights
    for row in rows.values():
        row["predicted"] = predicted_ttft(model, row["chunks"], 2, weights) if model else None
    if args.png and png_steps:
        from jaxcpp.tools.plot import plot_measured_vs_predicted

        first, end, chunks = png_steps
        steps = [t for t in dyn.engine.executor.timings() if first <= t.step_id < end]
        plot_measured_vs_predicted(steps, model, chunks, 2, args.png, "lone prompt, equal-latency chunks, PP 2",
                                   weights)
    for llm in (dyn, *engines.values()):
        llm.engine.close()
    return {"state": str(ctl.state), "model": ctl.describe_model(), "rows": list(rows.values())}


def over_flow_shop(llm, first_step: int) -> float:  # type: ignore[no-untyped-def]
    """How much longer the forwards of the steps since `first_step` spanned (first start to last done)
    than a flow shop of their own measured durations, each forward starting as soon as its input and
    its stage are ready: the time the pipe itself lost, whatever the forwards cost."""
    timings = [t for t in llm.engine.executor.timings() if t.step_id >= first_step]
    steps, stages = sorted({t.step_id for t in timings}), sorted({t.stage for t in timings})
    forward = {(t.step_id, t.stage): t.forward for t in timings}
    done = [0.0] * len(steps)
    for stage in stages:
        free = 0.0
        for i, step in enumerate(steps):
            free = done[i] = max(free, done[i]) + forward[step, stage]
    span = max(t.done for t in timings) - min(t.start for t in timings)
    return span / done[-1] - 1


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


def start_part(name: str, args: argparse.Namespace, extra: list[str], pin_self: bool,
               stdin: int | None = None) -> subprocess.Popen:
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
    return subprocess.Popen(pre + cmd, env=env, stdin=stdin, stdout=subprocess.PIPE, text=True)


def run_part(name: str, args: argparse.Namespace) -> dict:
    proc = start_part(name, args, [], pin_self=False)
    lines = proc.stdout.read().strip().splitlines()
    if proc.wait():
        raise RuntimeError(f"the {name} part failed (exit {proc.returncode})")
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
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix="jaxcpp_stage_bench_"))
    only = args.only.split(",")
    print(f"# stage processes benchmark, {os.cpu_count()} cores, load {os.getloadavg()}")
    if "speedup" in only or "ttft" in only:
        args.model = write_model(tmp / "big", 256, 8, 8, 2, args.prompt_len + 64)
    if "speedup" in only:
        speedup(args)
    if "ttft" in only:
        res = run_part("ttft", args)
        print(f"ttft (installed model: {res.get('model')}):")
        at_budget = next(r["measured"] for r in res["rows"] if r["policy"] == f"fixed {args.budget}")
        for r in res["rows"]:
            gain = statistics.median(b / a for a, b in zip(r["measured"], at_budget, strict=True))
            med = statistics.median(r["measured"])
            pred = (f"predicted {r['predicted']:.3f}s ({(med / r['predicted'] - 1) * 100:+.0f}%)"
                    if r["predicted"] else "no installed model to predict from")
            pipe = statistics.median(r["over_flow_shop"]) * 100
            print(f"  {r['policy']:>18}: measured {med:.3f}s {[round(t, 3) for t in r['measured']]}, {pred}, "
                  f"{gain:.3f}x the speed of fixed {args.budget} (median of rounds), forwards' span {pipe:+.1f}% over "
                  f"their flow shop (median), chunks {r['chunks']}")
    if "hostcost" in only:
        args.model = write_model(tmp / "small", 64, 8, 4, 2, 1024)
        res = run_part("hostcost", args)
        for pp, r in res.items():
            print(f"host cost P={pp}: control channel {r['control_us']:.0f} us, activation hop {r['hop_us']:.0f} us "
                  f"(medians over {r['n_control']} idle-stage receipts and {r['n_hops']} hops, {r['n']} micro-batches)")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
