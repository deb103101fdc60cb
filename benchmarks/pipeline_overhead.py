"""Host overhead of the pipeline executor per micro-batch, and the cost of its timing probes.

    .venv/bin/python benchmarks/pipeline_overhead.py [--steps 200] [--out table.md]

XLA:CPU does not speed up work spread over several devices of one process (they share one thread
pool), so a pipeline's wall-clock speed-up cannot be shown in-process on CPU. What can be measured is
what the host pays: `submit` on an idle pipe (stage the step onto every stage, hand activations on,
dispatch P programs), `collect` (FIFO retire, not reading tokens), and a steady loop that keeps P
micro-batches in flight and reads every step's tokens (one lap = collect the oldest + submit one),
each with the per-stage watcher threads switched off and on (and the loop once more also streaming the
Chrome trace). The model is a random 8-layer, hidden-64 Llama; the batch is one 64-token bucket.
Medians over `--steps` micro-batches after 20 untimed ones. The 1 × 1 row is the single-device
executor (no probes; its `collect` reads the tokens, so it includes the forward).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxcpp.config import EngineConfig  # noqa: E402
from jaxcpp.core.executor import StepRequest  # noqa: E402
from jaxcpp.core.sizing import EngineSizing  # noqa: E402
from jaxcpp.core.step_input import padding_step  # noqa: E402
from jaxcpp.models.checkpoint import save_hf  # noqa: E402
from jaxcpp.models.config import LlamaConfig  # noqa: E402
from jaxcpp.models.llama import init_params  # noqa: E402
from jaxcpp.models.spec import resolve_model_spec  # noqa: E402
from jaxcpp.runtime.factory import build_inproc_executor  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]
WARM = 20


def write_model(folder: Path) -> str:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, eos_token_ids=(1,))
    save_hf(folder, init_params(config, jax.random.key(0)), config)
    return str(folder)


def us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


STEP_IDS = itertools.count()  # every step submitted here has an id of its own


def steady_loop(executor, step, steps: int) -> float:
    """Median seconds per micro-batch with the pipe kept full and every step's tokens read."""
    in_flight, laps = [], []
    for i in range(WARM + steps):
        t0 = time.perf_counter()
        if len(in_flight) == executor.max_in_flight:
            _ = executor.collect(in_flight.pop(0)).tokens
        step_id = next(STEP_IDS)
        executor.submit(StepRequest(step_id, step))
        in_flight.append(step_id)
        if i >= WARM:
            laps.append(time.perf_counter() - t0)
    while in_flight:
        _ = executor.collect(in_flight.pop(0)).tokens
    return statistics.median(laps)


def idle_submits(executor, step, steps: int) -> tuple[list[float], list[float]]:
    """Host seconds of `submit` and `collect` (no wait) on an idle pipe with quiet watchers."""
    submit, collect = [], []
    for i in range(WARM + steps):
        time.sleep(0.003)  # the previous batch's watchers have gone back to sleep
        t0 = time.perf_counter()
        step_id = next(STEP_IDS)
        executor.submit(StepRequest(step_id, step, want_tokens=False))  # a middle prefill chunk: collect never waits
        t1 = time.perf_counter()
        executor.collect(step_id)
        t2 = time.perf_counter()
        jax.block_until_ready(executor.stages[-1].kv)  # drain, so every submit starts from an idle pipe
        if i >= WARM:
            submit.append(t1 - t0)
            collect.append(t2 - t1)
    return submit, collect


def measure(model: str, pp: int, tp: int, steps: int, trace_dir: Path) -> dict[str, float]:
    def build(trace: bool):
        kw = dict(model=model, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                  pipeline_parallel_size=pp, tensor_parallel_size=tp)
        if trace:
            kw["trace_file"] = str(trace_dir / f"trace_{pp}x{tp}.json")
        config = EngineConfig.from_kwargs(**kw)
        sizing = EngineSizing.plan(config, resolve_model_spec(model, "float32"))
        executor = build_inproc_executor(config, sizing)
        executor.warmup(sizing.shape)
        return executor, padding_step(64, sizing.shape)

    executor, step = build(trace=False)
    submit, collect = idle_submits(executor, step, steps)
    row = {"submit_us": us(submit), "collect_us": us(collect)}
    row["loop_probes_us"] = steady_loop(executor, step, steps) * 1e6
    timing = executor._timing
    watch = timing.watch
    timing.watch = lambda batches: None  # probes off: no records handed to the watchers
    row["submit_no_probes_us"] = us(idle_submits(executor, step, steps)[0])
    row["loop_no_probes_us"] = steady_loop(executor, step, steps) * 1e6
    timing.watch = watch
    executor.close()
    traced, _ = build(trace=True)
    row["loop_trace_us"] = steady_loop(traced, step, steps) * 1e6
    traced.close()
    return row


def table(rows: dict[tuple[int, int], dict[str, float]], steps: int) -> str:
    head = ("| P × T | submit, probes off (µs) | submit, probes on (µs) | collect, no wait (µs) | "
            "loop, probes off (µs/mb) | loop, probes on (µs/mb) | loop, probes + trace (µs/mb) |")
    lines = [head, "|" + "---|" * 7]
    keys = ("submit_no_probes_us", "submit_us", "collect_us", "loop_no_probes_us", "loop_probes_us",
            "loop_trace_us")
    for (pp, tp), r in rows.items():
        cells = [f"{r[k]:.0f}" if k in r else "–" for k in keys]
        lines.append(f"| {pp} × {tp} | " + " | ".join(cells) + " |")
    env = (f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPU "
           f"cores (shared), Python {platform.python_version()}; medians of {steps} micro-batches")
    return "\n".join(lines) + f"\n\n{env}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layouts", default=",".join(f"{p}x{t}" for p, t in LAYOUTS),
                        help="comma-separated PxT layouts, e.g. 1x1,2x1,4x2")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    layouts = [tuple(int(x) for x in lt.split("x")) for lt in args.layouts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        rows = {}
        for pp, tp in layouts:
            rows[(pp, tp)] = measure(model, pp, tp, args.steps, Path(tmp))
            print(f"{pp}x{tp}: {rows[(pp, tp)]}", file=sys.stderr, flush=True)
    text = table(rows, args.steps)
    print(text)
    if args.out:
        args.out.write_text("# Pipeline executor: host overhead per micro-batch\n\n"
                            "Written by `benchmarks/pipeline_overhead.py`; see its docstring and "
                            "docs/pipeline.md for what each column means.\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
