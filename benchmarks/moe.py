"""Mixture-of-experts benchmarks.

`gmm`: the grouped matmul (`jaxcpp.models.moe.grouped_experts`: tokens sorted by expert, tiles of rows
through their expert's weights under a scan) against the same with `jax.lax.ragged_dot`, and against
computing every expert on every token (`dense_experts`, the naive path), at 8-64 experts, top-2, the same
tokens and expert width: a grouped path's cost should follow the active parameters (flat in E), the
dense one the total (linear in E). Medians of --repeat timed calls after a warm-up,
both jitted, on this process's default backend.

`write-models DIR`: random Mixtral-shaped and Qwen3-MoE-shaped Hugging Face folders written by
transformers (for benchmarks/offline_throughput.py --model DIR/mixtral, DIR/qwen3_moe).

    .venv/bin/python benchmarks/moe.py gmm --tokens 512 --repeat 20
    .venv/bin/python benchmarks/moe.py write-models /tmp/moe_models
    .venv/bin/python -P benchmarks/offline_throughput.py --model /tmp/moe_models/mixtral ...   # -P: see below

On stage processes (TP 2 expert-parallel vs TP 1; dynamic-chunking calibration): benchmarks/moe_stages.py.

(`-P` keeps benchmarks/ off sys.path: its kernels.py would shadow the `kernels` package transformers imports.)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

SHAPES = {  # small enough for a 2-core CPU, shaped like the real ones (experts, top-k, dense layers)
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                      intermediate_size=512, head_dim=32),
}
COMMON = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)


def bench_gmm(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from jaxcpp.models.moe import dense_experts, grouped_experts, route

    print(f"backend {jax.default_backend()}, {args.tokens} tokens, D {args.hidden}, I {args.width}, top-{args.top_k}")
    print("experts | tiled ms | ragged_dot ms | dense ms | dense/tiled | active params | total params")
    for e in (8, 16, 32, 64):
        keys = jax.random.split(jax.random.key(e), 5)
        x = jax.random.normal(keys[0], (args.tokens, args.hidden))
        gate, up = (jax.random.normal(k, (e, args.hidden, args.width)) * 0.05 for k in keys[1:3])
        down = jax.random.normal(keys[3], (e, args.width, args.hidden)) * 0.05
        weights, ids = route(x, jax.random.normal(keys[4], (args.hidden, e)), args.top_k, True)
        times = {}
        ragged = functools.partial(grouped_experts, matmul="ragged_dot")
        for name, fn in (("tiled", grouped_experts), ("ragged", ragged), ("dense", dense_experts)):
            f = jax.jit(fn)
            jax.block_until_ready(f(x, ids, weights, gate, up, down))
            samples = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                jax.block_until_ready(f(x, ids, weights, gate, up, down))
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples) * 1e3
        np.testing.assert_allclose(grouped_experts(x, ids, weights, gate, up, down),
                                   dense_experts(x, ids, weights, gate, up, down), atol=1e-3)
        per_expert = 3 * args.hidden * args.width
        print(f"{e:7d} | {times['tiled']:8.2f} | {times['ragged']:13.2f} | {times['dense']:8.2f} | "
              f"{times['dense'] / times['tiled']:11.1f} | {args.top_k * per_expert:13,d} | {e * per_expert:12,d}")


def write_models(args: argparse.Namespace) -> None:
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent  # benchmarks/kernels.py would shadow transformers' `kernels`
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch
    import transformers

    for model_type, shape in SHAPES.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **COMMON, **shape)
        model = transformers.AutoModelForCausalLM.from_config(config)
        folder = Path(args.dir) / model_type
        model.save_pretrained(folder, safe_serialization=True)
        total = sum(p.numel() for p in model.parameters())
        print(f"{folder}: {total:,} parameters")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gmm")
    g.add_argument("--tokens", type=int, default=512)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--width", type=int, default=256)
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--repeat", type=int, default=20)
    w = sub.add_parser("write-models")
    w.add_argument("dir")
    args = p.parse_args()
    bench_gmm(args) if args.command == "gmm" else write_models(args)


if __name__ == "__main__":
    main()
