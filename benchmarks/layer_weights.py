"""Per-layer weights against stacked ones on XLA:CPU: two engines in one process, generates alternated.

`--layer-weights per-layer` keeps each decoder layer's weights as arrays of their own and runs the
layers one after the other in a stage's programs (`jaxcpp.runtime.stage.per_layer`); stacked weights
([L, ...], run under a scan) make XLA:CPU copy each layer's weights out of the stack before its dots,
every step. Both engines are built in this process (start-up, i.e. compiling every bucket, timed for
each; the second reuses what the first compiled that both share, the sampler among it, so compare cold
compile times in fresh processes with the persistent cache off, JAXCPP_COMPILATION_CACHE_DIR=), then
the same workloads alternate between them `--repeat` times; medians and the per-layer / stacked ratio
of each. Greedy tokens must match.

    JAXCPP_COMPILATION_CACHE_DIR=$(mktemp -d) .venv/bin/python benchmarks/layer_weights.py \
        --model /path/to/hf-llama --repeat 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

WORKLOADS = {"decode": (32, 64), "mixed": (512, 16)}  # prompt tokens, output tokens per request


def build(model: str, layer_weights: str, budget: int) -> tuple[object, float]:
    from jaxcpp import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=64, max_model_len=1024,
              log_stats_interval_s=0, enable_prefix_caching=False, layer_weights=layer_weights)
    return llm, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    from jaxcpp import SamplingParams

    engines = {}
    for name in ("stacked", "per-layer"):
        engines[name], startup = build(args.model, name, args.budget)
        print(f"{name}: start-up (compiling every bucket) {startup:.1f}s", flush=True)
    vocab = min(256, engines["stacked"].engine.tokenizer.vocab_size)
    rng = random.Random(0)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeat):
        for workload, (prompt_len, out) in WORKLOADS.items():
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(args.batch)]
            params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
            tokens = {}
            for name in (["stacked", "per-layer"] if r % 2 == 0 else ["per-layer", "stacked"]):
                t0 = time.perf_counter()
                outs = engines[name].generate(prompt_token_ids=prompts, sampling_params=params)
                times.setdefault((workload, name), []).append(time.perf_counter() - t0)
                tokens[name] = [o.token_ids for o in outs]
            same = sum(a == b for a, b in zip(tokens["stacked"], tokens["per-layer"], strict=True))
            print(f"  round {r + 1} {workload}: " + ", ".join(f"{n} {times[(workload, n)][-1]:.2f}s"
                                                         for n in ("stacked", "per-layer"))
                  + f"; greedy tokens identical in {same}/{len(prompts)}", flush=True)
    print(f"\nmodel {args.model}, batch {args.batch}, budget {args.budget}, load {os.getloadavg()}")
    print("| workload | stacked s | per-layer s | per-layer / stacked |\n| --- | ---: | ---: | ---: |")
    for workload in WORKLOADS:
        a, b = (statistics.median(times[(workload, n)]) for n in ("stacked", "per-layer"))
        print(f"| {workload} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
