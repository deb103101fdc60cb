"""Ragged paged attention: the Pallas kernel against the XLA path on decode-heavy, prefill-heavy and mixed
batches. Prints median time, achieved TFLOP/s and GB/s, and their fraction of this device's measured
peaks (a dense matmul and an elementwise copy timed in the same run).

    python benchmarks/kernels.py            # on a GPU: Llama-8B-like heads, real sizes (< 5 minutes)
    python benchmarks/kernels.py --small    # on CPU: tiny shapes; XLA path timed, kernel interpreted
                                            # once on the smallest batch as a smoke test
    python benchmarks/kernels.py --tiny-model --baseline main   # on CPU: the bundled model's attention
                                            # at engine sizes (page table of 2048 tokens), the XLA path
                                            # now and at git revision `main` side by side
    python benchmarks/kernels.py --llama-30m --dtype float32   # on CPU: the vs-vLLM 30m model's heads;
                                            # "xla,decode-ops": its decode rows as XLA ops, not the C++ kernel

FLOPs count only what causality lets a query see (4 * head_dim * num_heads per visible KV position);
bytes are the minimum traffic: q and out once, each sequence's K/V once per KV head.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.kernels.backend import is_rocm, select_attention
from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.ragged_paged_attention import ragged_paged_attention_reference

# name -> (new tokens per sequence, cached prefix per sequence, padded tokens T, padded sequences S[,
# max model length: the page table's width, by default the longest sequence])
GPU_SCENARIOS = {
    "decode-heavy": ([1] * 256, list(np.linspace(512, 4095, 256, dtype=int)), 256, 256),
    "prefill-heavy": ([1024] * 4, [0, 2048, 4096, 8192], 4096, 8),
    "mixed": ([1] * 128 + [1920], list(np.linspace(512, 4095, 128, dtype=int)) + [4096], 2048, 136),
}
SMALL_SCENARIOS = {
    "decode-heavy": ([1] * 16, list(range(20, 180, 10)), 64, 16),
    "prefill-heavy": ([40, 24], [0, 64], 64, 4),
    "mixed": ([1] * 8 + [56], list(range(30, 110, 10)) + [32], 64, 12),
}
# The bundled tiny model's attention in the engine's shapes: buckets of T tokens with S = min(T, 64)
# sequences, a page table of max_model_len 2048 (its max_position_embeddings).
TINY_MODEL_SCENARIOS = {
    "decode-64@512-2k": ([1] * 64, list(np.linspace(512, 2047, 64, dtype=int)), 64, 64, 2048),
    "decode-64@128-272": ([1] * 64, list(np.linspace(128, 271, 64, dtype=int)), 64, 64, 2048),
    "decode-64@200": ([1] * 64, [200] * 64, 64, 64, 2048),  # the decode-heavy workload: contexts alike
    "decode-16@512-2k": ([1] * 16, list(np.linspace(512, 2047, 16, dtype=int)), 64, 64, 2048),
    "mixed-32+448": ([1] * 32 + [448], list(np.linspace(512, 2047, 32, dtype=int)) + [1024], 512, 64, 2048),
    "prefill-512@1k": ([512], [1024], 512, 64, 2048),
}
TINY_MODEL_HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=32)
# The vs-vLLM 30m Llama (GQA 8/4, head 64) as it serves the mixed workload at concurrency 16, budget 512,
# max_model_len 1280: decode-only steps of 16 rows, and steps with a prompt chunk beside the decodes.
LLAMA_30M_SCENARIOS = {
    "decode-16@512-640": ([1] * 16, list(np.linspace(512, 639, 16, dtype=int)), 16, 16, 1280),
    "decode-16@32-160": ([1] * 16, list(np.linspace(32, 159, 16, dtype=int)), 16, 16, 1280),
    "mixed-15+497": ([1] * 15 + [497], list(np.linspace(512, 639, 15, dtype=int)) + [0], 512, 64, 1280),
}
LLAMA_30M_HEADS = dict(num_heads=8, num_kv_heads=4, head_dim=64)


def median_seconds(fn: Callable[[], jax.Array], iters: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], jax.Array]], iters: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn round by round, so load on a shared machine
    falls on all of them alike (side-by-side comparisons stay fair)."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_peaks(dtype, *, n: int, copy_bytes: int, iters: int) -> tuple[float, float]:
    """(matmul TFLOP/s, copy GB/s) of this device, timed now."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    matmul = jax.jit(lambda a: a @ a)
    tflops = 2 * n**3 / median_seconds(lambda: matmul(a), iters) / 1e12
    x = jnp.ones((copy_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)  # reads and writes every byte once
    gbps = 2 * copy_bytes / median_seconds(lambda: copy(x), iters) / 1e9
    return tflops, gbps


def build_batch(q_lens, prefixes, num_tokens, num_seqs, max_model_len=None, *, page_size, num_heads,
                num_kv_heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(prefixes) + np.asarray(q_lens)
    pages_per_seq = -(-int(max_model_len or kv_lens.max()) // page_size)
    num_pages = 1 + sum(-(-int(n) // page_size) for n in kv_lens)
    free = iter(1 + rng.permutation(num_pages - 1))
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    cu_q_lens = np.full(num_seqs + 1, sum(q_lens), np.int32)
    cu_q_lens[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    for s, n in enumerate(kv_lens):
        page_indices[s, : -(-int(n) // page_size)] = [next(free) for _ in range(-(-int(n) // page_size))]
    md = AttentionMetadata(
        positions=jnp.zeros(num_tokens, jnp.int32), slot_mapping=jnp.zeros(num_tokens, jnp.int32),
        cu_q_lens=jnp.asarray(cu_q_lens), kv_lens=jnp.asarray(np.pad(kv_lens, (0, num_seqs - len(q_lens)))
                                                         .astype(np.int32)),
        page_indices=jnp.asarray(page_indices), num_seqs=jnp.int32(len(q_lens)),
        num_decodes=jnp.int32(sum(n == 1 for n in q_lens)),
    )
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (num_tokens, num_heads, head_dim), dtype)
    k_pages = jax.random.normal(keys[1], (num_pages, page_size, num_kv_heads, head_dim), dtype)
    v_pages = jax.random.normal(keys[2], (num_pages, page_size, num_kv_heads, head_dim), dtype)
    # A chunk of q_len new tokens after `prefix` cached ones sees q_len * prefix + q_len (q_len + 1) / 2 keys.
    visible = sum(n * prefix + n * (n + 1) // 2 for n, prefix in zip(q_lens, prefixes, strict=True))
    flops = 4 * head_dim * num_heads * visible
    itemsize = jnp.dtype(dtype).itemsize
    q_and_out = 2 * sum(q_lens) * num_heads * head_dim
    nbytes = itemsize * (q_and_out + 2 * int(kv_lens.sum()) * num_kv_heads * head_dim)
    return (q, k_pages, v_pages, md), flops, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU run")
    parser.add_argument("--tiny-model", action="store_true",
                        help="the bundled tiny model's attention heads at engine sizes (CPU, ~1 minute)")
    parser.add_argument("--llama-30m", action="store_true",
                        help="the vs-vLLM 30m model's heads at its serving sizes (CPU, float32: pass --dtype)")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time the XLA path of kernels/ragged_paged_attention.py at git revision REV")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=None, help="timed runs per case (median is printed)")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not (args.small or args.tiny_model or args.llama_30m):
        print("no GPU: running the --small shapes (the full ones would take hours on CPU)")
        args.small = True
    if args.llama_30m:
        scenarios, heads, iters = LLAMA_30M_SCENARIOS, LLAMA_30M_HEADS, 20
        peak_n, peak_bytes = 512, 64 << 20
    elif args.tiny_model:
        scenarios, heads, iters = TINY_MODEL_SCENARIOS, TINY_MODEL_HEADS, 10
        peak_n, peak_bytes = 512, 64 << 20
    elif args.small:
        scenarios, heads, iters = SMALL_SCENARIOS, dict(num_heads=4, num_kv_heads=2, head_dim=64), 5
        peak_n, peak_bytes = 512, 64 << 20
    else:
        scenarios, heads, iters = GPU_SCENARIOS, dict(num_heads=32, num_kv_heads=8, head_dim=128), 20
        peak_n, peak_bytes = 8192, 2 << 30
    iters = args.iters or iters
    kind = jax.devices()[0].device_kind + (" (ROCm)" if is_rocm() else "")
    print(f"device: {kind}; backend {jax.default_backend()}; jax {jax.__version__}; dtype {dtype.name}; "
          f"page_size {args.page_size}; {heads}")
    peak_tflops, peak_gbps = measure_peaks(dtype, n=peak_n, copy_bytes=peak_bytes, iters=iters)
    print(f"measured peaks: matmul {peak_tflops:.3f} TFLOP/s, copy {peak_gbps:.1f} GB/s\n")
    paths = {"reference": jax.jit(ragged_paged_attention_reference),
             "xla": jax.jit(select_attention("xla")),
             "pallas": jax.jit(select_attention("pallas"))}
    if not on_gpu:  # decode rows, or prefill chunks, through XLA ops instead of the C++ kernels
        for part in ("decode", "prefill"):
            paths[f"xla,{part}-ops"] = jax.jit(functools.partial(select_attention("xla"), **{f"{part}_kernel": "xla"}))
    if args.baseline:
        from baseline import module_at_revision

        old = module_at_revision("kernels/ragged_paged_attention.py", args.baseline)
        paths[f"xla@{args.baseline}"] = jax.jit(old.ragged_paged_attention_xla)
    smallest = min(scenarios, key=lambda name: scenarios[name][2])
    width = max(14, *map(len, scenarios))
    print(f"{'scenario':<{width}} {'path':<16} {'T':>5} {'S':>4} {'median ms':>10} {'TFLOP/s':>8} {'%peak':>6} "
          f"{'GB/s':>8} {'%peak':>6} {'max err':>8}")
    for name, (q_lens, prefixes, num_tokens, num_seqs, *max_model_len) in scenarios.items():
        batch, flops, nbytes = build_batch(q_lens, prefixes, num_tokens, num_seqs, *max_model_len,
                                           page_size=args.page_size, dtype=dtype, **heads)
        expected = paths["reference"](*batch)
        # Interpret mode measures the interpreter, not the kernel: off a GPU, one smoke run only.
        timed = {path: functools.partial(fn, *batch) for path, fn in paths.items()
                 if on_gpu or path != "pallas"}
        medians = interleaved_medians(timed, iters)
        if not on_gpu and name == smallest:
            medians["pallas"] = median_seconds(functools.partial(paths["pallas"], *batch), 1)
        for path, seconds in medians.items():
            fn = paths[path]
            err = float(jnp.max(jnp.abs(fn(*batch).astype(jnp.float32) - expected.astype(jnp.float32))))
            label = "pallas(interp)" if path == "pallas" and not on_gpu else path
            tflops, gbps = flops / seconds / 1e12, nbytes / seconds / 1e9
            print(f"{name:<{width}} {label:<16} {num_tokens:>5} {num_seqs:>4} {seconds * 1e3:>10.3f} "
                  f"{tflops:>8.3f} {100 * tflops / peak_tflops:>5.1f}% {gbps:>8.1f} "
                  f"{100 * gbps / peak_gbps:>5.1f}% {err:>8.1e}")


if __name__ == "__main__":
    main()
