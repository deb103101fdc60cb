"""Host overhead: how long the device sits idle waiting for the engine loop, with and without async
scheduling, at decode batch 1, 16 and 64 (the bundled model, prompt 16, 128 output tokens, greedy).

    .venv/bin/python benchmarks/host_overhead.py [--batches 1 16 64] [--output-len 128] [--repeat 3]
    .venv/bin/python benchmarks/host_overhead.py --batches 1 --baseline main   # + async with main's ladder

Two engines (async on and off) are built once and run the same batches alternately. The device's
busy intervals come from the pipeline executor's per-stage watchers (`StageTiming.start/done`, see
`jaxcpp.runtime.timing`). Over the run's span (first start to last end), "waiting for the host" is the
part of each gap between one step's end and the next step's start before the host had dispatched the
next step; "other gaps" is the rest (inputs not yet on the device: the step's buffer, the fed-back
tokens, and the watcher thread's own wake-up latency, which the CPU backend cannot tell apart). The
engine loop's own phases (`HostPhase`: schedule, build, dispatch, wait, postprocess) are summed per
step. Medians of `--repeat` runs; the runs of both modes alternate so machine load falls on both alike.
`--baseline REV` adds a third engine, async with the bucket ladder of git revision REV.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

PHASES = ("schedule", "build", "dispatch", "wait", "postprocess")


def build(async_scheduling: bool, args: argparse.Namespace, revision: str | None = None):  # type: ignore[no-untyped-def]
    from jaxcpp import LLM

    if revision:  # this engine only: the ladder of `revision`
        from baseline import use_ladder_at

        import jaxcpp.core.sizing as sizing

        saved = sizing.token_buckets, sizing.decode_buckets
        use_ladder_at(revision)
        try:
            return build(async_scheduling, args)
        finally:
            sizing.token_buckets, sizing.decode_buckets = saved
    llm = LLM(model=args.model, dtype="float32", max_num_seqs=max(args.batches), max_model_len=16 + args.output_len,
              async_scheduling=async_scheduling, log_stats_interval_s=0, enable_prefix_caching=False)
    phases: list = []
    record = llm.engine.executor.record_host_phases

    def recording(done):  # type: ignore[no-untyped-def]
        phases.extend(done)
        record(done)

    llm.engine.executor.record_host_phases = recording
    return llm, phases


def run_once(llm, phases: list, batch: int, args: argparse.Namespace, seed: int) -> dict:  # type: ignore[no-untyped-def]
    import numpy as np

    from jaxcpp import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 250, 16).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    executor = llm.engine.executor
    first_step = llm.engine.scheduler.num_steps
    phases.clear()
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    time.sleep(0.2)  # let the watchers record the last step
    timings = sorted((t for t in executor.timings() if t.step_id >= first_step), key=lambda t: t.step_id)
    span = timings[-1].done - timings[0].start
    pairs = list(zip(timings, timings[1:], strict=False))
    gaps = sum(max(0.0, b.start - a.done) for a, b in pairs)
    host = sum(max(0.0, min(b.dispatched, b.start) - a.done) for a, b in pairs)
    per_phase: dict[str, float] = defaultdict(float)
    for p in phases:
        per_phase[p.name] += p.end - p.start
    steps = len(timings)
    return {"batch": batch, "wall_s": wall, "steps": steps, "step_ms": 1e3 * span / steps,
            "device_ms": 1e3 * sum(t.forward for t in timings) / steps, "idle_share": host / span,
            "other_gaps": (gaps - host) / span,
            "tok_s": batch * args.output_len / wall,
            **{f"{name}_ms": 1e3 * per_phase[name] / steps for name in PHASES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline", metavar="REV", help="also run async with the bucket ladder of git revision REV")
    p.add_argument("--json", help="write every run here")
    args = p.parse_args()

    engines = {"sync": build(False, args), "async": build(True, args)}
    if args.baseline:
        engines[f"async@{args.baseline}"] = build(True, args, args.baseline)
    for llm, phases in engines.values():  # one untimed run each: first-call costs out of the way
        run_once(llm, phases, max(args.batches), args, seed=99)
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in range(args.repeat):
        for batch in args.batches:
            for mode, (llm, phases) in engines.items():
                runs[(mode, batch)].append(run_once(llm, phases, batch, args, seed=r))
                last = runs[(mode, batch)][-1]
                print(f"  {mode:12} batch {batch:3}: {last['tok_s']:8.1f} tok/s, device waits for the host "
                      f"{100 * last['idle_share']:5.1f}%, other gaps {100 * last['other_gaps']:5.1f}%", flush=True)

    cols = ["tok_s", "step_ms", "device_ms", "idle_share", "other_gaps", *(f"{n}_ms" for n in PHASES)]
    print("\nmedians of", args.repeat, "runs")
    print(f"{'batch':>5} {'mode':>12} " + " ".join(f"{c:>13}" for c in cols))
    for batch in args.batches:
        for mode in engines:
            rs = runs[(mode, batch)]
            med = {c: statistics.median(r[c] for r in rs) for c in cols}
            cells = [f"{100 * med[c]:12.1f}%" if c in ("idle_share", "other_gaps") else f"{med[c]:13.2f}"
                     for c in cols]
            print(f"{batch:5} {mode:>12} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": {f"{m}/{b}": rs for (m, b), rs in runs.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
