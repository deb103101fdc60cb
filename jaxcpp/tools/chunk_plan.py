"""`jaxcpp chunk-plan`: the chunks a policy picks for one prompt, their predicted times and TTFT.

How it moves: the main `jaxcpp` CLI calls `add_parser(subparsers)`, argparse calls `run(args)`.
`main(argv)` builds a parser with only this subcommand, for tests and `python -m`. The chosen policy's
plan is printed beside fixed chunks of B, B/2 and B/4; `--json` prints the same for machines; `--plot`
simulates fixed-B and the chosen policy and draws both pipeline timelines.

The engine-side flags are the engine's own (`jaxcpp.config` through `jaxcpp.cli_args`, named as for
`jaxcpp serve`), and the settings are built from them as the engine builds its controller's, so a plan
here is the plan the engine would follow with the same flags and coefficients.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import chunk_times, predicted_ttft
from jaxcpp.chunking.planner import ChunkSettings, plan_fixed, settings_from_config
from jaxcpp.chunking.policy import plan_chunks
from jaxcpp.cli_args import add_config_args, engine_config_from_args
from jaxcpp.config import CacheConfig, ChunkingConfig, ParallelConfig, SchedulerConfig

# The engine flags a plan depends on, by config field: the same flags `jaxcpp serve` takes.
_ENGINE_FLAGS = (
    (SchedulerConfig, ("max_num_batched_tokens",)),
    (ParallelConfig, ("pipeline_parallel_size", "pp_partition")),
    (CacheConfig, ("page_size",)),
    (ChunkingConfig, ("dynamic_chunking_policy", "dynamic_chunking_smooth_factor",
                      "dynamic_chunking_min_chunk_size")),
)
_REQUIRED = ("max_num_batched_tokens", "pipeline_parallel_size")


def add_parser(subparsers: Any) -> None:
    """Register `chunk-plan` on an argparse subparsers object (sets `func=run`)."""
    p = subparsers.add_parser("chunk-plan", description=__doc__.splitlines()[0],
                              help="plan the prefill chunks of one prompt under a latency model")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt length in tokens (required)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--coeffs", help="latency model a,b,c,gamma of one pipeline stage, in seconds, e.g. "
                        "2.9e-10,5.365e-6,0.02,4.727e-7 (ratios such as 1,18500,0,1630 plan the same chunks, "
                        "but the times printed are then in those units, not seconds; this or --model-file "
                        "is required)")
    source.add_argument("--model-file", help="latency model JSON (LatencyModel.save; calibration writes "
                        "seconds; this or --coeffs is required)")
    p.add_argument("--fit-error", type=float, default=0.0,
                   help="the calibrated model's fit error as a fraction, as the engine logs it ('fit error "
                   "3.90%%' is 0.039): optimal runs the middle one of the fixed chunks predicted within it of "
                   "its best plan, where there are any (default 0: the model taken as exact)")
    for config_cls, names in _ENGINE_FLAGS:
        add_config_args(p, config_cls, only=names, required=_REQUIRED)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="draw fixed-B and the policy's pipeline timelines into this PNG (default: no plot)")
    p.set_defaults(func=run)


def _entry(name: str, chunks: list[int], model: LatencyModel, settings: ChunkSettings) -> dict[str, Any]:
    times = chunk_times(model, chunks)
    return {"name": name, "chunks": chunks, "chunk_times": [float(t) for t in times],
            "ttft": predicted_ttft(model, chunks, settings.pipeline_parallel_size, settings.stage_weights)}


def build_report(prompt_len: int, policy: str, model: LatencyModel, settings: ChunkSettings,
                 fit_error: float = 0.0) -> dict[str, Any]:
    budget = settings.budget
    plans = [_entry(policy, plan_chunks(policy, prompt_len, settings, model, fit_error=fit_error), model, settings)]
    for size in dict.fromkeys(max(budget // d, 1) for d in (1, 2, 4)):
        plans.append(_entry(f"fixed {size}", plan_fixed(prompt_len, size), model, settings))
    return {"prompt_len": prompt_len, "budget": budget,
            "pipeline_parallel_size": settings.pipeline_parallel_size, "policy": policy,
            "smooth_factor": settings.smooth_factor, "min_chunk_size": settings.min_chunk_size,
            "alignment": settings.alignment, "model": json.loads(model.to_json()), "fit_error": fit_error,
            "plans": plans}


def format_report(report: dict[str, Any]) -> str:
    chosen, fixed_b = report["plans"][0], report["plans"][1]
    lines = [f"prompt {report['prompt_len']} tokens, budget {report['budget']}, "
             f"PP {report['pipeline_parallel_size']}, policy {report['policy']} (smoothing "
             f"{report['smooth_factor']}, min chunk {report['min_chunk_size']}, "
             f"alignment {report['alignment']})",
             "model: " + " ".join(f"{k}={report['model'][k]:.6g}" for k in ("a", "b", "c", "gamma"))
             + f", fit error {report['fit_error']:.2%}"
             + " (times below are in the coefficients' units: seconds for a calibrated model)",
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
        config = engine_config_from_args(args)  # validates like the engine; errors name the flag
        if not 0.0 <= args.fit_error < 1.0:
            raise ValueError(f"--fit-error must be in [0, 1), got {args.fit_error}")
        settings = settings_from_config(config)
        report = build_report(args.prompt_len, config.chunking.dynamic_chunking_policy, model, settings,
                              args.fit_error)
    except (OSError, ValueError) as err:  # ConfigError is a ValueError; it names the flag
        print(f"chunk-plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if args.plot:
        from jaxcpp.tools.plot import plot_timelines
        from jaxcpp.tools.simulator import Pipeline, simulate_plan

        # The flow shop the table's TTFT scores: no limit on micro-batches in flight (the engine's P
        # in flight moves an uneven plan's TTFT by ~0.1%), so each panel's TTFT is the table's.
        plans = report["plans"][1::-1]
        pipeline = Pipeline(model, settings.pipeline_parallel_size, settings.stage_weights,
                            max_in_flight=max(len(plan["chunks"]) for plan in plans))
        runs = {plan["name"]: simulate_plan(pipeline, plan["chunks"]) for plan in plans}
        title = f"prompt {args.prompt_len}, PP {settings.pipeline_parallel_size}"
        plot_timelines(runs, args.plot, title=title)
        print(f"chunk-plan: wrote the timelines of {' and '.join(runs)} to {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxcpp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
