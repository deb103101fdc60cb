"""Offline throughput: jaxcpp's `LLM.generate` against Hugging Face `generate` on the same weights.

One mixed-length workload (prompts 32-1024 tokens, outputs 16-256), in batches of 32 for both. jaxcpp
compiles every bucket at start-up; that time is reported apart from the generation time. HF runs each
batch left-padded, greedy, to the batch's longest output (its `generate` cannot stop rows separately
without wasting their slots), and only the tokens each request asked for are counted for either engine.

    .venv/bin/python benchmarks/offline_throughput.py --num-requests 64 --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, min(vocab, 256), int(rng.integers(32, 1025))).tolist() for _ in range(n)]
    outputs = [int(x) for x in rng.integers(16, 257, n)]
    return prompts, outputs


def run_jaxcpp(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    from jaxcpp import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.batch_size, max_model_len=1024 + 256, log_stats_interval_s=0)
    startup = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outputs]
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        llm.generate(prompt_token_ids=prompts[i:i + args.batch_size], sampling_params=params[i:i + args.batch_size])
    elapsed = time.perf_counter() - t0
    return {"startup_s": startup, "compile_s": llm.engine.warmup_seconds, "generate_s": elapsed,
            "output_tok_s": sum(outputs) / elapsed, "total_tok_s": (sum(outputs) + sum(map(len, prompts))) / elapsed}


def run_hf(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxcpp.models.checkpoint import resolve_model, save_hf

    torch.set_num_threads(os.cpu_count() or 1)
    config, params, _ = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, params, config)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    pad = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i:i + args.batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                           max_new_tokens=max(outputs[i:i + args.batch_size]), min_new_tokens=1,
                           eos_token_id=None)
    elapsed = time.perf_counter() - t0
    return {"generate_s": elapsed, "output_tok_s": sum(outputs) / elapsed,
            "total_tok_s": (sum(outputs) + sum(map(len, prompts))) / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    from jaxcpp.models.checkpoint import resolve_model

    vocab = resolve_model(args.model)[0].vocab_size
    prompts, outputs = workload(args.num_requests, vocab, args.seed)
    print(f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))} "
          f"(median {statistics.median(map(len, prompts)):.0f}), output tokens {sum(outputs)}, "
          f"batches of {args.batch_size}")
    results = {"jaxcpp": run_jaxcpp(args, prompts, outputs)}
    if not args.skip_hf:
        results["hf"] = run_hf(args, prompts, outputs)
    print(f"{'engine':8} {'generate s':>11} {'output tok/s':>13} {'total tok/s':>12}")
    for name, r in results.items():
        print(f"{name:8} {r['generate_s']:11.1f} {r['output_tok_s']:13.1f} {r['total_tok_s']:12.1f}")
    j = results["jaxcpp"]
    print(f"jaxcpp start-up {j['startup_s']:.1f}s, of which compiling every bucket {j['compile_s']:.1f}s")
    if "hf" in results:
        print(f"ratio jaxcpp / HF output tokens/s: {j['output_tok_s'] / results['hf']['output_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
