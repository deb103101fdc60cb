"""One MLA attention layer on this CPU: absorbed vs rebuilt prefill per chunk size (the crossover), and
chunk time against the cached prefix (γ), fitted with the project's fitting code.

    .venv/bin/python benchmarks/mla_prefill.py [--heads 8] [--iters 5] [--json out.json]

The layer: DeepSeek-V3's per-head layout (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128) with its 128 heads scaled down to `--heads` (8) and hidden size 1024, no q LoRA (as
DeepSeek-V2-Lite), random weights: q_proj, kv_a_proj_with_mqa, kv_a_layernorm, RoPE on the rope parts,
the latent rows written to pages, attention (`jaxcpp.kernels.mla_attention.mla_attention_xla`, the CPU
path, absorbed or rebuilt), o_proj. The FLOP crossover r·(dn + dv)/(2r − dn − dv) = 170.7 tokens does
not depend on the head count, so the scaled layer keeps it. One sequence: a chunk of x tokens after L
cached ones, x a compiled shape, L data. float32. Every shape is timed `--iters` times after a
warm-up, the forms and shapes round-robin (a shared machine's load falls on all alike); medians, and
the γ fit once more on each shape's fastest run.

Fits (`jaxcpp.chunking.fitting.fit_free`): t(L, x) = c + γ·L + b·x + a·(2·L·x + x²) on the γ grid, with
each coefficient's standard error, and the same with γ forced to 0; and the engine's own route (b, c from
the L = 0 row by `fit_startup`, then `fit_runtime` with its acceptance checks).
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

from jaxcpp.chunking.fitting import Rejection, fit_free, fit_runtime, fit_startup
from jaxcpp.chunking.mla_cost import (
    MlaShape,
    asymptotic_crossover,
    attention_flops,
    crossover_chunk,
    latency_terms,
)
from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.mla_attention import mla_attention_xla, split_kv_b, write_latent_pages

HIDDEN, RANK, ROPE, NOPE, V_DIM, PAGE = 1024, 512, 64, 128, 128, 16
CROSSOVER_PREFIX = 4096
CROSSOVER_CHUNKS = (32, 64, 128, 192, 256, 384, 512)
GAMMA_CHUNKS = (32, 64, 128, 256)  # small chunks: where γ·L outweighs the pairs (γ/2a = 410 tokens by FLOPs)
GAMMA_PREFIXES = (0, 2048, 4096, 8192)


def init_params(heads: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * shape[0] ** -0.5, jnp.float32)  # noqa: E731
    kv_b = jnp.asarray(rng.standard_normal((heads * (NOPE + V_DIM), RANK)) * RANK**-0.5, jnp.float32)
    w_uk, w_uv = split_kv_b(kv_b, heads, NOPE, V_DIM)  # transformers' kv_b_proj layout, cut per head
    return {"q_proj": normal(HIDDEN, heads * (NOPE + ROPE)), "kv_a": normal(HIDDEN, RANK + ROPE),
            "kv_norm": jnp.ones(RANK, jnp.float32), "w_uk": w_uk, "w_uv": w_uv, "o_proj": normal(heads * V_DIM, HIDDEN)}


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotate-half RoPE, theta 10000, on the last axis of x [T, ..., ROPE]."""
    inv = 1.0 / 10000.0 ** (jnp.arange(0, ROPE, 2, dtype=jnp.float32) / ROPE)
    angle = positions[:, None].astype(jnp.float32) * inv[None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    while cos.ndim < x.ndim:
        cos, sin = cos[:, None], sin[:, None]
    half = ROPE // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@functools.partial(jax.jit, static_argnames=("rebuild", "sm_scale"), donate_argnames=("pages",))
def mla_layer(params: dict[str, jax.Array], x: jax.Array, pages: jax.Array, md: AttentionMetadata, *,
              rebuild: bool, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    heads = params["w_uk"].shape[1]
    q = (x @ params["q_proj"]).reshape(x.shape[0], heads, NOPE + ROPE)
    kv = x @ params["kv_a"]
    c = kv[:, :RANK]
    c = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-6) * params["kv_norm"]
    pages = write_latent_pages(pages, c, rope(kv[:, RANK:], md.positions), md.slot_mapping)
    out = mla_attention_xla(q[..., :NOPE], rope(q[..., NOPE:], md.positions), pages, params["w_uk"],
                            params["w_uv"], md, sm_scale=sm_scale, rebuild_prefill=rebuild)
    return out.reshape(x.shape[0], heads * V_DIM) @ params["o_proj"], pages


def one_chunk(prefix: int, chunk: int, pages_per_seq: int) -> AttentionMetadata:
    pos = np.arange(prefix, prefix + chunk, dtype=np.int32)
    table = np.arange(1, pages_per_seq + 1, dtype=np.int32)[None, :]  # page 0 stays the padding page
    return AttentionMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(table[0, pos // PAGE] * PAGE + pos % PAGE),
        cu_q_lens=jnp.array([0, chunk], jnp.int32), kv_lens=jnp.array([prefix + chunk], jnp.int32),
        page_indices=jnp.asarray(table), num_seqs=jnp.int32(1), num_decodes=jnp.int32(0))


def time_shapes(shapes: list[tuple[str, int, int]], heads: int,
                iters: int) -> dict[tuple[str, int, int], list[float]]:
    """Seconds of each (form, chunk, prefix), `iters` each, round-robin over shapes, after one warm-up each."""
    max_context = max(p + x for _, x, p in shapes)
    pages_per_seq = -(-max_context // PAGE)
    params = init_params(heads)
    rng = np.random.default_rng(1)
    pages = jnp.asarray(rng.standard_normal((pages_per_seq + 1, PAGE, RANK + ROPE)), jnp.float32)
    inputs = {s: (jnp.asarray(rng.standard_normal((s[1], HIDDEN)), jnp.float32), one_chunk(s[2], s[1], pages_per_seq))
              for s in shapes}
    sm_scale = (NOPE + ROPE) ** -0.5

    def run(shape: tuple[str, int, int]) -> float:
        nonlocal pages
        x, md = inputs[shape]
        start = time.perf_counter()
        out, pages = mla_layer(params, x, pages, md, rebuild=shape[0] == "rebuilt", sm_scale=sm_scale)
        out.block_until_ready()
        return time.perf_counter() - start

    for shape in shapes:
        run(shape)  # compile (one per form and chunk size) and warm up
    times: dict[tuple[str, int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(iters):
        for shape in shapes:
            times[shape].append(run(shape))
    return times


def crossover_table(t: dict[tuple[str, int, int], float], shape: MlaShape) -> list[str]:
    lines = [f"Absorbed vs rebuilt at L = {CROSSOVER_PREFIX} (FLOP crossover "
             f"{crossover_chunk(shape, CROSSOVER_PREFIX):.1f} tokens here, {asymptotic_crossover(shape):.1f} "
             "for L >> x):", "",
             "| chunk x | absorbed ms | rebuilt ms | rebuilt / absorbed | FLOP ratio |", "|---|---|---|---|---|"]
    for x in CROSSOVER_CHUNKS:
        ab, rb = t[("absorbed", x, CROSSOVER_PREFIX)], t[("rebuilt", x, CROSSOVER_PREFIX)]
        flops = (attention_flops(shape, CROSSOVER_PREFIX, x, "rebuilt")
                 / attention_flops(shape, CROSSOVER_PREFIX, x, "absorbed"))
        lines.append(f"| {x} | {ab * 1e3:.1f} | {rb * 1e3:.1f} | {rb / ab:.2f} | {flops:.2f} |")
    return lines


def fit_lines(t: dict[tuple[str, int, int], float], form: str, shape: MlaShape) -> tuple[list[str], dict[str, float]]:
    keys = [(form, x, p) for x in GAMMA_CHUNKS for p in GAMMA_PREFIXES]
    chunks, prefixes = [k[1] for k in keys], [k[2] for k in keys]
    seconds = [t[k] for k in keys]
    full, zero = fit_free(chunks, prefixes, seconds), fit_free(chunks, prefixes, seconds, with_gamma=False)
    m, e = full.model, full.errors
    lines = [f"{form}: a={m.a:.4g}±{e.a:.2g} b={m.b:.4g}±{e.b:.2g} c={m.c:.4g}±{e.c:.2g} "
             f"gamma={m.gamma:.4g}±{e.gamma:.2g} s; fit error {full.fit_error:.1%}",
             f"{form}, gamma forced to 0: a={zero.model.a:.4g} b={zero.model.b:.4g} c={zero.model.c:.4g}; "
             f"fit error {zero.fit_error:.1%}"]
    if form == "rebuilt":
        _, a_flop = latency_terms(shape, 1, 1.0)
        lines.append(f"rebuilt gamma/a = {m.gamma / m.a:.0f} measured, {shape.kv_b_flops / a_flop:.0f} by FLOPs; "
                     f"gamma*L share of t(L=8192, x=256): {m.gamma * 8192 / m.predict(8192, 256):.1%}")
        row0 = [(x, t[(form, x, 0)]) for x in GAMMA_CHUNKS]
        startup = fit_startup([x for x, _ in row0], [s for _, s in row0])
        if isinstance(startup, Rejection):
            lines.append(f"engine route: start-up fit rejected: {startup.reason}")
        else:
            runtime = fit_runtime(chunks, prefixes, seconds, *startup, budget=max(GAMMA_CHUNKS))
            lines.append("engine route (fit_startup on L=0, then fit_runtime): " +
                         (f"rejected: {runtime.reason}" if isinstance(runtime, Rejection) else runtime.describe()))
    table = ["", f"| {form}: x \\ L | " + " | ".join(str(p) for p in GAMMA_PREFIXES) + " |",
             "|---|" + "---|" * len(GAMMA_PREFIXES)]
    for x in GAMMA_CHUNKS:
        cells = [f"{t[(form, x, p)] * 1e3:.1f} ({m.predict(p, x) * 1e3:.1f} / {zero.model.predict(p, x) * 1e3:.1f})"
                 for p in GAMMA_PREFIXES]
        table.append(f"| {x} | " + " | ".join(cells) + " |")
    summary = {"gamma": m.gamma, "gamma_err": e.gamma, "a": m.a, "b": m.b, "c": m.c,
               "fit_error": full.fit_error, "fit_error_gamma0": zero.fit_error}
    return lines + table, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="also write the medians and fits here")
    args = parser.parse_args()
    shape = MlaShape(args.heads, RANK, NOPE, ROPE, V_DIM)
    shapes = sorted({(f, x, CROSSOVER_PREFIX) for f in ("absorbed", "rebuilt") for x in CROSSOVER_CHUNKS}
                    | {(f, x, p) for f in ("absorbed", "rebuilt") for x in GAMMA_CHUNKS for p in GAMMA_PREFIXES})
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    start = time.perf_counter()
    runs = time_shapes(shapes, args.heads, args.iters)
    t = {s: statistics.median(v) for s, v in runs.items()}
    print(f"device {jax.devices()[0].platform}, jax {jax.__version__}, {os.cpu_count()} CPUs; load at start: {load}")
    print(f"layer: {args.heads} heads (DeepSeek-V3: 128), r {RANK}, dr {ROPE}, dn {NOPE}, dv {V_DIM}, hidden "
          f"{HIDDEN}, float32; medians of {args.iters}; {time.perf_counter() - start:.0f} s\n")
    print("\n".join(crossover_table(t, shape)) + "\n")
    summaries = {}
    for form in ("rebuilt", "absorbed"):
        lines, summaries[form] = fit_lines(t, form, shape)
        print("\n".join(lines) + "\n")
    print("cells: measured ms (4-term fit / gamma=0 fit)")
    # The fastest of each shape's runs: what the shape costs when the shared machine leaves it alone.
    fastest = {s: min(v) for s, v in runs.items()}
    for form in ("rebuilt", "absorbed"):
        print("fastest runs, " + fit_lines(fastest, form, shape)[0][0])
    if args.json:
        with open(args.json, "w") as f:
            named = {f"{k[0]} x={k[1]} L={k[2]}": v for k, v in runs.items()}
            json.dump({"runs": named, "fits": summaries}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
