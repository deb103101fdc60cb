"""Predicted TTFT of dynamic chunking on a DeepSeek-V3-shaped stand-in: the 4-term latency model (γ·L from
MLA's prefix rebuild) against a planner fed a fit with γ forced to 0, and fixed 8K / 16K / 32K chunks.

    .venv/bin/python benchmarks/simulate_mla_chunking.py [--gamma-over-a R] [--output table.md]

Every number is PREDICTED: lone prompts of 128K and 256K tokens through `jaxcpp.tools.simulator` on a
pipeline whose stages cost the "true" model below. The planners (`plan_optimal`, `plan_equal_latency`,
the engine's settings: base 32K, smoothing 0.75, min chunk 4096) plan either with the true model or
with the γ = 0 fit, and every plan is then run on the true pipeline.

The true model, per stage, from DeepSeek-V3's shape and FLOPs (`jaxcpp.chunking.mla_cost`): the largest
stage's layers (`stage_layers`: 16 of 61 at PP 4, 8 at PP 8); attention in the rebuilt form (every
planned chunk is far above the 171-token crossover) at 1.1 PFLOP/s: γ = kv_b_proj's 33.6 MFLOP per
cached token a layer, a = half a causal pair's 81,920 FLOPs a layer (γ/a = 819, the shape's); b = 2 x
37B/61 active parameters per token a layer at 3 PFLOP/s (the MoE, FP4) plus the chunk's own rebuild;
c = 20 ms. These are the assumptions of benchmarks/simulate_dynamic_chunking.py, with γ and a counted
for V3 instead of taken from ATOM's Kimi-K2.5 ratios. `--gamma-over-a` replaces γ by R·a (e.g. the
ratio measured on this CPU by benchmarks/mla_prefill.py), keeping a.

The γ = 0 fit (`gamma_zero_fit`): what calibration would install if it could not see γ: b and c from
the start-up sweep, a and c refitted on the true model's noise-free times over a calibration-like grid
(chunks 4K-32K, prefixes 0 to the prompt length) without the L column.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxcpp.chunking.fitting import Rejection, fit_startup
from jaxcpp.chunking.latency_model import LatencyModel, attention_area
from jaxcpp.chunking.mla_cost import MlaShape, latency_terms
from jaxcpp.chunking.optimal import plan_optimal
from jaxcpp.chunking.planner import ChunkSettings, plan_equal_latency, plan_fixed
from jaxcpp.core.sizing import stage_layers
from jaxcpp.tools.simulator import Pipeline, simulate_plan

V3 = MlaShape.deepseek_v3()
LAYERS = 61
ACTIVE_PARAMS_PER_LAYER = 37e9 / LAYERS
ATTENTION_FLOPS_PER_S = 1.1e15
MOE_FLOPS_PER_S = 3e15
C_S = 0.02
HOP_S, HOP_S_PER_TOKEN = 2e-4, 2.2e-7
BASE = 32768
FIXED = (8192, 16384, 32768)


def true_model(pp: int, gamma_over_a: float | None = None) -> LatencyModel:
    layers = max(end - start for start, end in stage_layers(LAYERS, pp))
    gamma, a = latency_terms(V3, layers, ATTENTION_FLOPS_PER_S)
    b = (2 * ACTIVE_PARAMS_PER_LAYER * layers / MOE_FLOPS_PER_S
         + V3.kv_b_flops * layers / ATTENTION_FLOPS_PER_S)  # the chunk's own tokens' K/V rebuild
    return LatencyModel(a=a, b=b, c=C_S, gamma=gamma if gamma_over_a is None else gamma_over_a * a)


def gamma_zero_fit(model: LatencyModel, prompt_len: int) -> LatencyModel:
    """What calibration installs when it cannot see γ: b and c from the attention-free start-up sweep
    (`fit_startup`: exact here, t = c + b·x), then a and c refitted on the runtime samples without the
    L column, as `fit_runtime` does after dropping γ (`fitting.fit_free` on t − b·x, b held)."""
    sizes = [4096, 8192, 16384, 32768]
    startup = fit_startup(sizes, [model.c + model.b * x for x in sizes])
    assert not isinstance(startup, Rejection)
    b, _ = startup
    chunks = np.array([x for x in sizes for _ in range(9)], float)
    prefixes = np.array([int(f * (prompt_len - x)) for x in sizes for f in np.linspace(0, 1, 9)], float)
    seconds = model.predict(prefixes, chunks)
    area = attention_area(prefixes, chunks)
    (a, c), *_ = np.linalg.lstsq(np.stack([area / area.max(), np.ones_like(area)], axis=1), seconds - b * chunks,
                                 rcond=None)
    return LatencyModel(a=a / area.max(), b=b, c=c, gamma=0.0)


def plans(prompt_len: int, pp: int, truth: LatencyModel, fit0: LatencyModel) -> dict[str, list[int]]:
    settings = ChunkSettings(budget=BASE, smooth_factor=0.75, min_chunk_size=4096, pipeline_parallel_size=pp)
    out = {f"fixed {s // 1024}K": plan_fixed(prompt_len, s) for s in FIXED}
    for name, model in (("4-term", truth), ("gamma=0", fit0)):
        out[f"optimal {name}"] = plan_optimal(model, prompt_len, settings)
        out[f"equal-latency {name}"] = plan_equal_latency(prompt_len, settings, model)
    return out


def run(gamma_over_a: float | None) -> list[str]:
    names = [f"fixed {s // 1024}K" for s in FIXED] + [f"{p} {m}" for p in ("optimal", "equal-latency")
                                                          for m in ("4-term", "gamma=0")]
    head = ("| prompt | PP | γ·L share | " + " | ".join(names)
            + " | opt 4-term vs best fixed | opt 4-term vs opt γ=0 | EL 4-term vs EL γ=0 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for prompt_len in (131072, 262144):
        for pp in (4, 8):
            truth = true_model(pp, gamma_over_a)
            fit0 = gamma_zero_fit(truth, prompt_len)
            pipeline = Pipeline(truth, pp, hop_s=HOP_S, hop_s_per_token=HOP_S_PER_TOKEN)
            ttft = {name: simulate_plan(pipeline, chunks).mean_ttft
                    for name, chunks in plans(prompt_len, pp, truth, fit0).items()}
            best = min(ttft[f"fixed {s // 1024}K"] for s in FIXED)
            # γ·L's share of the last 8K chunk of the prompt: where it weighs most.
            share = truth.gamma * (prompt_len - 8192) / truth.predict(prompt_len - 8192, 8192)
            cells = [f"{prompt_len // 1024}K", str(pp), f"{share:.1%}"] + [f"{ttft[n]:.3f}" for n in names]
            cells += [f"{(1 - ttft['optimal 4-term'] / best) * 100:+.2f}%",
                      f"{(1 - ttft['optimal 4-term'] / ttft['optimal gamma=0']) * 100:+.2f}%",
                      f"{(1 - ttft['equal-latency 4-term'] / ttft['equal-latency gamma=0']) * 100:+.2f}%"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def describe(gamma_over_a: float | None) -> str:
    m = true_model(4, gamma_over_a)
    source = "from V3's FLOPs" if gamma_over_a is None else f"γ = {gamma_over_a:g}·a"
    return f"PP 4 stage (16 layers), {source}: {m.describe()} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gamma-over-a", type=float, help="γ as this multiple of a (default: from FLOPs)")
    parser.add_argument("--output", help="also write the table here")
    args = parser.parse_args()
    start = time.perf_counter()
    lines = run(args.gamma_over_a)
    text = "\n".join([f"Predicted mean TTFT (s), lone prompts; {describe(args.gamma_over_a)}; "
                      f"{time.perf_counter() - start:.1f} s on the host.", "", *lines]) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
