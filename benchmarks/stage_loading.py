"""Peak host memory while a pipeline stage loads its own layers, against loading the whole model.

    python benchmarks/stage_loading.py [--layers 8] [--hidden 512] [--format hf|orbax]

Writes a random Llama (float32) to a temp folder, then for P in 1, 2, 4 measures the peak resident set
growth of `load_stage_params` for each stage, each in a fresh interpreter (Linux: the peak RSS is reset
through /proc/self/clear_refs before the load and read from VmHWM after it), and reports the largest.
tensorstore's (orbax) buffers are C++ allocations, so RSS, not tracemalloc, is what counts them. Prints
a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxcpp.core.sizing import stage_layers  # noqa: E402
from jaxcpp.models.checkpoint import load_stage_params, save_hf, save_orbax  # noqa: E402
from jaxcpp.models.config import LlamaConfig  # noqa: E402
from jaxcpp.models.llama import init_params  # noqa: E402
from jaxcpp.models.spec import resolve_model_spec  # noqa: E402


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def peak_mib(spec, layers, is_first, is_last) -> float:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    before = _status_kib("VmRSS")
    params = load_stage_params(spec, layers, is_first, is_last)
    peak = _status_kib("VmHWM")
    del params
    return (peak - before) / 1024


def measure_in_subprocess(folder: str, pp: int, stage: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--measure", folder, str(pp), str(stage)], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(folder: str, pp: int, stage: int) -> None:
    spec = resolve_model_spec(folder)
    bounds = stage_layers(spec.config.num_hidden_layers, pp)[stage]
    print(peak_mib(spec, bounds, stage == 0, stage == pp - 1))


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--format", choices=("hf", "orbax"), default="hf")
    args = ap.parse_args()
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=args.hidden // 8, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as folder:
        params = init_params(config, jax.random.key(0))
        (save_hf if args.format == "hf" else save_orbax)(folder, params, config)
        del params
        print(f"| P | largest stage's layers | peak RSS growth, MiB (largest stage) | vs P = 1 |  ({args.format}, "
              f"{args.layers} layers, hidden {args.hidden})")
        print("| --- | --- | --- | --- |")
        whole = None
        for pp in (1, 2, 4):
            worst = max(measure_in_subprocess(folder, pp, s) for s in range(pp))
            whole = whole or worst
            layers = max(e - b for b, e in stage_layers(args.layers, pp))
            print(f"| {pp} | {layers} | {worst:.1f} | {worst / whole:.2f} |")


if __name__ == "__main__":
    main()
