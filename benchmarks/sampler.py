"""The sampler program alone: this checkout's `sample_step` against another revision's sampler, interleaved.

    .venv/bin/python benchmarks/sampler.py --baseline main --vocab 264,32000

For each vocabulary size and temperature (0: greedy, 0.8: a draw), W rows of random logits go through
both programs in turn, jitted and warm; the medians of `--calls` timed calls are printed. This
checkout's program is the plain one (no row with penalties or min_tokens: what most steps run) and,
with `--full`, the one with the penalty history and the ban. The baseline's `sample(logits,
temperature, top_k, top_p, seeds, steps)` is read from `git show REV:jaxcpp/runtime/sampler.py`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.runtime import sampler
from jaxcpp.sampling_params import MAX_BANNED_IDS


def baseline_sampler(rev: str) -> Any:
    source = subprocess.run(["git", "show", f"{rev}:jaxcpp/runtime/sampler.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_interleaved(programs: dict[str, Any], calls: int) -> list[tuple[str, list[float]]]:
    """Each program once per round, `calls` rounds, after one untimed call each (compile, warm)."""
    times: dict[str, list[float]] = {name: [] for name in programs}
    for fn in programs.values():
        jax.block_until_ready(fn())
    for _ in range(calls):
        for name, fn in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return list(times.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--vocab", type=lambda s: [int(v) for v in s.split(",")], default=[264, 32000])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--full", action="store_true", help="also this checkout's full program (a history)")
    args = parser.parse_args()
    old = baseline_sampler(args.baseline)
    w, t = args.rows, 2048
    for vocab in args.vocab:
        logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (w, vocab)).astype(np.float32))
        for temperature in (0.0, 0.8):
            row = [jnp.full(w, temperature), jnp.zeros(w, jnp.int32), jnp.ones(w), jnp.arange(w, dtype=jnp.uint32),
                   jnp.zeros(w, jnp.int32)]
            x = sampler.SamplingInput(logits, *row, jnp.zeros(w), jnp.zeros(w), jnp.zeros(w), jnp.ones(w),
                                      jnp.full(w, -1, jnp.int32), jnp.full(w, -1, jnp.int32),
                                      jnp.full((w, MAX_BANNED_IDS), -1, jnp.int32), jnp.zeros(w, jnp.int32),
                                      jnp.zeros(t, jnp.int32), jnp.full(t, -1, jnp.int32))
            before, now = jax.jit(old.sample), jax.jit(sampler.sample_step)
            programs = {"baseline": functools.partial(before, logits, *row), "plain": functools.partial(now, x, None)}
            if args.full:  # jitted here without donation, so one history serves every call
                programs["full"] = functools.partial(now, x, sampler.empty_history(w, vocab))
            medians = {name: statistics.median(times) * 1e6 for name, times in time_interleaved(programs, args.calls)}
            print(f"vocab {vocab:>6} temperature {temperature}: " + ", ".join(
                f"{name} {us:.0f} us" for name, us in medians.items())
                  + f"; plain / baseline {medians['plain'] / medians['baseline']:.3f}", flush=True)


if __name__ == "__main__":
    main()
