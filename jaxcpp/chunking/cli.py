"""`jaxcpp chunk-plan`: the chunks a policy picks for one prompt, their predicted times and TTFT.

How it moves: the main `jaxcpp` CLI calls `add_parser(subparsers)`, argparse calls `run(args)`.
`main(argv)` builds a parser with only this subcommand, for tests and `python -m`. The chosen policy's
plan is printed beside fixed chunks of B, B/2 and B/4; `--json` prints the same for machines; `--plot`
simulates fixed-B and the chosen policy and draws both pipeline timelines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import chunk_times, predicted_ttft
from jaxcpp.chunking.planner import ChunkSettings, plan_fixed, stage_weights_from_layers
from jaxcpp.chunking.policy import plan_chunks


def add_parser(subparsers: Any) -> None:
    """Register `chunk-plan` on an argparse subparsers object (sets `func=run`)."""
    p = subparsers.add_parser("chunk-plan", description=__doc__.splitlines()[0],
                              help="plan the prefill chunks of one prompt under a latency model")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt length in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, required=True,
                   help="token budget B: the first, reference and largest chunk")
    p.add_argument("--pipeline-parallel-size", type=int, required=True, help="pipeline stages P")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--coeffs", help="latency model a,b,c,gamma (seconds)")
    source.add_argument("--model-file", help="latency model JSON (LatencyModel.save)")
    p.add_argument("--policy", default="equal-latency", choices=("equal-latency", "optimal", "fixed"))
    p.add_argument("--smooth-factor", type=float,
                   default=float(os.environ.get("JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "0.75")),
                   help="0 = fixed chunks, 1 = the solved equal-latency chunk (default: env "
                        "JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR, else 0.75)")
    p.add_argument("--min-chunk-size", type=int, default=4096, help="smallest chunk the solver may choose")
    p.add_argument("--block-size", type=int, default=16, help="KV page size; chunks align to max(it, 64)")
    p.add_argument("--pp-partition", help="layers per stage, e.g. 15,15,15,16 (uneven stages)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="draw fixed-B and the policy's pipeline timelines")
    p.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> ChunkSettings:
    weights = None
    if args.pp_partition:
        weights = stage_weights_from_layers([int(v) for v in args.pp_partition.split(",")])
    return ChunkSettings(budget=args.max_num_batched_tokens, smooth_factor=args.smooth_factor,
                         min_chunk_size=args.min_chunk_size, page_size=args.block_size,
                         pipeline_parallel_size=args.pipeline_parallel_size, stage_weights=weights)


def _entry(name: str, chunks: list[int], model: LatencyModel, settings: ChunkSettings) -> dict[str, Any]:
    times = chunk_times(model, chunks)
    return {"name": name, "chunks": chunks, "chunk_times": [float(t) for t in times],
            "ttft": predicted_ttft(model, chunks, settings.pipeline_parallel_size, settings.stage_weights)}


def build_report(args: argparse.Namespace, model: LatencyModel, settings: ChunkSettings) -> dict[str, Any]:
    budget = settings.budget
    plans = [_entry(args.policy, plan_chunks(args.policy, args.prompt_len, settings, model), model, settings)]
    for size in dict.fromkeys(max(budget // d, 1) for d in (1, 2, 4)):
        plans.append(_entry(f"fixed {size}", plan_fixed(args.prompt_len, size), model, settings))
    return {"prompt_len": args.prompt_len, "budget": budget,
            "pipeline_parallel_size": settings.pipeline_parallel_size, "policy": args.policy,
            "smooth_factor": settings.smooth_factor, "min_chunk_size": settings.min_chunk_size,
            "alignment": settings.alignment, "model": json.loads(model.to_json()), "plans": plans}


def format_report(report: dict[str, Any]) -> str:
    chosen, fixed_b = report["plans"][0], report["plans"][1]
    lines = [f"prompt {report['prompt_len']} tokens, budget {report['budget']}, "
             f"PP {report['pipeline_parallel_size']}, policy {report['policy']} (smoothing "
             f"{report['smooth_factor']}, min chunk {report['min_chunk_size']}, "
             f"alignment {report['alignment']})",
             "model: " + " ".join(f"{k}={report['model'][k]:.6g}" for k in ("a", "b", "c", "gamma")),
             "", f"{report['policy']} chunks (tokens, predicted time):"]
    lines += [f"  {i:3d}  {x:7d}  {t:.6g}" for i, (x, t) in
              enumerate(zip(chosen["chunks"], chosen["chunk_times"], strict=True))]
    lines += ["", f"{'plan':<16}{'chunks':>7}{'max chunk time':>16}{'predicted TTFT':>16}{'vs fixed B':>12}"]
    for plan in report["plans"]:
        gain = 1.0 - plan["ttft"] / fixed_b["ttft"]
        lines.append(f"{plan['name']:<16}{len(plan['chunks']):>7}{max(plan['chunk_times']):>16.6g}"
                     f"{plan['ttft']:>16.6g}{gain:>+12.1%}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        model = LatencyModel.load(args.model_file) if args.model_file else LatencyModel.parse_coeffs(args.coeffs)
        settings = _settings(args)
        report = build_report(args, model, settings)
    except (OSError, ValueError) as err:
        print(f"chunk-plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if args.plot:
        from jaxcpp.tools.plot import plot_timelines
        from jaxcpp.tools.simulator import Pipeline, simulate_plan

        pipeline = Pipeline(model, settings.pipeline_parallel_size, settings.stage_weights)
        runs = {plan["name"]: simulate_plan(pipeline, plan["chunks"]) for plan in report["plans"][1::-1]}
        title = f"prompt {args.prompt_len}, PP {settings.pipeline_parallel_size}"
        plot_timelines(runs, args.plot, title=title)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxcpp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
