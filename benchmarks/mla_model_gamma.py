"""γ on the real MLA model: chunk time against the cached prefix through the DeepSeek-V3 decoder itself
(`llama.run_layers` over latent pages, the engine's code path), fitted with the project's fitting code.

    .venv/bin/python benchmarks/mla_model_gamma.py [--heads 8] [--iters 3] [--json out.json]

benchmarks/mla_prefill.py times one hand-built MLA layer; this one runs a random DeepSeek-V3-shaped
model (jaxcpp.models: q LoRA 384, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, YaRN, hidden 1024,
`--heads` heads, one dense layer then one MoE layer of 16 experts top-2 with a shared expert and the
grouped sigmoid router), float32, one sequence: a chunk of x tokens after L cached ones (x a compiled
shape, L data). Three attention forms: `auto` (what the engine runs: `mla_attention_auto`, the per-step
FLOP rule), and forced `rebuilt` / `absorbed` (`mla_attention_xla`). Round-robin over shapes and forms,
medians of `--iters` after a warm-up. Fits: t(L, x) = c + γ·L + b·x + a·(2·L·x + x²) with standard
errors, and the same with γ forced to 0 (`jaxcpp.chunking.fitting.fit_free`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.chunking.fitting import fit_free
from jaxcpp.chunking.mla_cost import MlaShape, latency_terms
from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.mla_attention import mla_attention_xla
from jaxcpp.models import llama
from jaxcpp.models.config import ModelConfig
from jaxcpp.models.mla import softmax_scale

PAGE = 16
CHUNKS = (32, 64, 128, 256)
PREFIXES = (0, 2048, 4096, 8192)
FORMS = ("auto", "rebuilt", "absorbed")


def model_config(heads: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=64, max_position_embeddings=16384, architecture="DeepseekV3ForCausalLM",
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True, dense_layers=(0,),
        router="sigmoid", topk_method="group_limited", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        n_shared_experts=1, kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                      "mscale": 1.0, "mscale_all_dim": 1.0})


def one_chunk(prefix: int, chunk: int, pages_per_seq: int) -> AttentionMetadata:
    pos = np.arange(prefix, prefix + chunk, dtype=np.int32)
    table = np.arange(1, pages_per_seq + 1, dtype=np.int32)[None, :]
    return AttentionMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(table[0, pos // PAGE] * PAGE + pos % PAGE),
        cu_q_lens=jnp.array([0, chunk], jnp.int32), kv_lens=jnp.array([prefix + chunk], jnp.int32),
        page_indices=jnp.asarray(table), num_seqs=jnp.int32(1), num_decodes=jnp.int32(0))


def attention_for(form: str, config: ModelConfig):  # noqa: ANN201
    if form == "auto":
        return llama.default_attention(config)
    return functools.partial(mla_attention_xla, sm_scale=softmax_scale(config), rebuild_prefill=form == "rebuilt")


def time_shapes(config: ModelConfig, iters: int) -> dict[tuple[str, int, int], list[float]]:
    shapes = [(f, x, p) for f in FORMS for x in CHUNKS for p in PREFIXES]
    pages_per_seq = -(-(max(PREFIXES) + max(CHUNKS)) // PAGE)
    params = llama.init_params(config, jax.random.key(0))
    kv = llama.make_kv_cache(config, 2, pages_per_seq + 1, PAGE)
    rng = np.random.default_rng(1)
    kv = kv._replace(k=jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32))  # a "cached" prefix
    kv = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), kv)  # k_scale and v_scale: one buffer each
    programs = {f: jax.jit(functools.partial(llama.run_layers, config=config, attention_fn=attention_for(f, config)),
                           donate_argnums=(2,)) for f in FORMS}
    inputs = {(x, p): (jnp.asarray(rng.standard_normal((x, config.hidden_size)) * 0.1, jnp.float32),
                       one_chunk(p, x, pages_per_seq)) for x in CHUNKS for p in PREFIXES}

    def run(shape: tuple[str, int, int]) -> float:
        nonlocal kv
        hidden, md = inputs[shape[1:]]
        start = time.perf_counter()
        out, kv = programs[shape[0]](params["layers"], hidden, kv, md)
        out.block_until_ready()
        return time.perf_counter() - start

    for shape in shapes:
        run(shape)
    times: dict[tuple[str, int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(iters):
        for shape in shapes:
            times[shape].append(run(shape))
    return times


def fit_lines(t: dict[tuple[str, int, int], float], form: str, shape: MlaShape) -> tuple[list[str], dict]:
    keys = [(form, x, p) for x in CHUNKS for p in PREFIXES]
    chunks, prefixes, seconds = [k[1] for k in keys], [k[2] for k in keys], [t[k] for k in keys]
    full, zero = fit_free(chunks, prefixes, seconds), fit_free(chunks, prefixes, seconds, with_gamma=False)
    m, e = full.model, full.errors
    _, a_flop = latency_terms(shape, 1, 1.0)
    lines = [f"{form}: a={m.a:.4g}±{e.a:.2g} b={m.b:.4g}±{e.b:.2g} c={m.c:.4g}±{e.c:.2g} "
             f"gamma={m.gamma:.4g}±{e.gamma:.2g} s; fit error {full.fit_error:.1%}; gamma/a {m.gamma / m.a:.0f} "
             f"(rebuilt by FLOPs {shape.kv_b_flops / a_flop:.0f})",
             f"{form}, gamma forced to 0: a={zero.model.a:.4g} b={zero.model.b:.4g} c={zero.model.c:.4g}; "
             f"fit error {zero.fit_error:.1%}",
             "", f"| {form}: x \\ L | " + " | ".join(str(p) for p in PREFIXES) + " |",
             "|---|" + "---|" * len(PREFIXES)]
    for x in CHUNKS:
        lines.append(f"| {x} | " + " | ".join(f"{t[(form, x, p)] * 1e3:.1f} ({m.predict(p, x) * 1e3:.1f} / "
                                              f"{zero.model.predict(p, x) * 1e3:.1f})" for p in PREFIXES) + " |")
    return lines, {"gamma": m.gamma, "gamma_err": e.gamma, "a": m.a, "b": m.b, "c": m.c,
                   "fit_error": full.fit_error, "fit_error_gamma0": zero.fit_error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", help="also write the runs and fits here")
    args = parser.parse_args()
    config = model_config(args.heads)
    shape = MlaShape(args.heads, 512, 128, 64, 128)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    start = time.perf_counter()
    runs = time_shapes(config, args.iters)
    t = {s: statistics.median(v) for s, v in runs.items()}
    print(f"device {jax.devices()[0].platform}, jax {jax.__version__}, {os.cpu_count()} CPUs; load at start: {load}")
    print(f"model: DeepSeek-V3-shaped, {args.heads} heads, 1 dense + 1 MoE layer, float32; medians of {args.iters}; "
          f"{time.perf_counter() - start:.0f} s\n")
    fits = {}
    for form in FORMS:
        lines, fits[form] = fit_lines(t, form, shape)
        print("\n".join(lines) + "\n")
    print("cells: measured ms (4-term fit / gamma=0 fit)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": {f"{k[0]} x={k[1]} L={k[2]}": v for k, v in runs.items()}, "fits": fits}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
