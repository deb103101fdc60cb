"""Attention on CPU, a C++ kernel against XLA ops: two engines in one process, generates alternated.

The XLA path's decode rows (`--part decode`) or prefill chunks (`--part prefill`) either go through
`jaxcpp.kernels.cpu_attention` (C++ custom calls reading K/V pages in place; the default on CPU) or
through XLA ops that gather pages into fresh operands each layer of each step (`decode_kernel="xla"`,
`prefill_kernel="xla"`); the other part takes its kernel in both engines. Both engines are built in this
process, then the same workloads alternate between them `--repeat` times, the order flipped every round;
medians of the generate's seconds and of every request's inter-token latencies (ITL), the kernel / ops
ratios and their per-round values. Greedy tokens are compared.

    .venv/bin/python benchmarks/cpu_attention.py --model /tmp/vsv/models/30m --repeat 3
    .venv/bin/python benchmarks/cpu_attention.py --part prefill --repeat 3     # the bundled model

`--serving` runs the vs-vLLM serving cell instead (`benchmarks/vs_vllm.py`'s servers and vLLM's own
client, so it needs the vLLM venv `vs_vllm.py --setup` makes): `jaxcpp serve` with both kernels and with
`JAXCPP_CPU_ATTENTION_KERNEL` keeping only the other part's, alternating, a warm-up wave each, 32
prompts of 512 in / 128 out at concurrency 16, budget 512, max model length 1280:

    .venv/bin/python benchmarks/cpu_attention.py --serving --model /tmp/vsv/models/30m --repeat 2
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import tempfile
import time

WORKLOADS = {"decode": (512, 128), "mixed": (512, 16)}  # prompt tokens, output tokens per request
NAMES = ("ops", "kernel")  # the part as XLA ops; as its C++ kernel
SWITCH_ENV = "JAXCPP_CPU_ATTENTION_KERNEL"  # kernels/cpu_attention.py: "decode" / "prefill": that kernel only
OTHER = {"decode": "prefill", "prefill": "decode"}


def build(model: str, name: str, part: str, budget: int) -> object:
    """An engine whose XLA attention path takes `part` through `name`'s implementation."""
    import jaxcpp.runtime.stage_ops as stage_ops
    from jaxcpp import LLM
    from jaxcpp.kernels.backend import select_attention

    chosen = functools.partial(select_attention("xla"), **{f"{part}_kernel": "xla" if name == "ops" else "cpp"})
    original = stage_ops.select_attention
    stage_ops.select_attention = lambda backend, **kw: chosen
    try:
        return LLM(model=model, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=64,
                   max_model_len=1280, log_stats_interval_s=0, enable_prefix_caching=False)
    finally:
        stage_ops.select_attention = original


def serving(model: str, part: str, rounds: int) -> None:
    """The vs-vLLM mixed cell at concurrency 16 against `jaxcpp serve` with and without `part`'s kernel."""
    from pathlib import Path

    import vs_vllm

    args = vs_vllm.parse_args(["--models", "30m", "--workloads", "mixed", "--concurrency", "16",
                               "--max-num-batched-tokens", "512", "--max-model-len", "1280"])
    work = Path(tempfile.mkdtemp(prefix=f"cpu-{part}-serving-"))
    results: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            env = {**os.environ, SWITCH_ENV: OTHER[part] if name == "ops" else "1"}
            server = vs_vllm.start("jaxcpp", Path(model), args, work / f"{name}-{r}.log", env=env)
            try:
                vs_vllm.bench(server, Path(model), "mixed", 16, 16, 10_000 + r, args, work / f"warm-{name}-{r}.json")
                out = vs_vllm.bench(server, Path(model), "mixed", 16, 32, r, args, work / f"{name}-{r}.json")
            finally:
                server.stop()
            results.setdefault(name, []).append(out)
            metrics = "  ".join(f"{label} {out[key]:.1f}" for key, label, _ in vs_vllm.METRICS)
            print(f"  round {r + 1} {name:6} {metrics}  load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\nmodel {model}, load {os.getloadavg()}, logs in {work}")
    print("| metric | XLA ops | C++ kernel | kernel / ops |\n| --- | ---: | ---: | ---: |")
    for key, label, _ in vs_vllm.METRICS:
        a, b = (statistics.median(x[key] for x in results[n]) for n in NAMES)
        print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--part", choices=tuple(OTHER), default="decode")
    p.add_argument("--serving", action="store_true", help="the vs-vLLM serving cell, not offline generates")
    args = p.parse_args()
    if args.serving:
        serving(args.model, args.part, args.repeat)
        return
    from jaxcpp import SamplingParams

    engines = {}
    for name in NAMES:
        t0 = time.perf_counter()
        engines[name] = build(args.model, name, args.part, args.budget)
        print(f"{name}: start-up {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = min(256, engines["ops"].engine.tokenizer.vocab_size)
    rng = random.Random(0)
    times: dict[tuple[str, str], list[float]] = {}
    itls: dict[tuple[str, str], list[float]] = {}  # median ITL of each generate
    ratios: dict[str, list[float]] = {}
    for r in range(args.repeat):
        for workload, (prompt_len, out) in WORKLOADS.items():
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(args.batch)]
            params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
            tokens = {}
            for name in NAMES if r % 2 == 0 else NAMES[::-1]:
                t0 = time.perf_counter()
                outs = engines[name].generate(prompt_token_ids=prompts, sampling_params=params)
                times.setdefault((workload, name), []).append(time.perf_counter() - t0)
                itls.setdefault((workload, name), []).append(statistics.median(
                    gap for o in outs for gap in o.metrics.itl))
                tokens[name] = [o.token_ids for o in outs]
            ratios.setdefault(workload, []).append(times[(workload, "kernel")][-1] / times[(workload, "ops")][-1])
            same = sum(a == b for a, b in zip(tokens["ops"], tokens["kernel"], strict=True))
            print(f"  round {r + 1} {workload}: " + ", ".join(
                f"{n} {times[(workload, n)][-1]:.2f}s (median ITL {itls[(workload, n)][-1] * 1e3:.1f} ms)"
                for n in NAMES) + f"; greedy tokens identical in {same}/{len(prompts)}; load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"\nmodel {args.model}, {args.part}, batch {args.batch}, budget {args.budget}, load {os.getloadavg()}")
    print("| workload | XLA ops s | C++ kernel s | kernel / ops | per round | median ITL ms, ops / kernel | ratio |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for workload in WORKLOADS:
        a, b = (statistics.median(times[(workload, n)]) for n in NAMES)
        ia, ib = (statistics.median(itls[(workload, n)]) * 1e3 for n in NAMES)
        rounds = ", ".join(f"{x:.2f}" for x in ratios[workload])
        print(f"| {workload} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {rounds} | {ia:.1f} / {ib:.1f} | {ib / ia:.2f}x |")


if __name__ == "__main__":
    main()
