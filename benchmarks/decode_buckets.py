"""Decode-only rungs against none, in one process: the same workload through two engines, alternating.

    .venv/bin/python benchmarks/decode_buckets.py [--workload mixed] [--max-num-batched-tokens 512] [--repeat 3]

One engine has the decode-only rungs (8, 16, 32: `jaxcpp.core.buckets.decode_buckets`), the other is built
with none, as before they existed; everything else is the same code. Each run is timed end to end,
and every step's device time comes from the executor's per-stage watchers (`StageTiming`). Decode-only
steps are grouped by how many sequences they carried (1-8, 9-16, 17-32, 33-64: the rung each takes),
so the table shows what a rung saves a step against the 64-token bucket, and the wall times whether
the workload as a whole gained. One process, alternating: load on a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from offline_throughput import MAX_PROMPT, workload

BANDS = ((8, "1-8"), (16, "9-16"), (32, "17-32"), (64, "33-64"))


def build(args: argparse.Namespace, rungs: bool, max_model_len: int):  # type: ignore[no-untyped-def]
    import jaxcpp.core.sizing as sizing
    from jaxcpp import LLM

    saved = sizing.decode_buckets
    if not rungs:
        sizing.decode_buckets = lambda max_num_seqs, page_size: []
    try:
        return LLM(model=args.model, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.batch_size, max_model_len=max_model_len, log_stats_interval_s=0)
    finally:
        sizing.decode_buckets = saved


def run_once(llm, prompts: list[list[int]], params: list) -> tuple[float, dict[str, list[float]]]:  # type: ignore[no-untyped-def]
    """Wall seconds, and the device ms of each step by kind (decode-only bands, or with chunks)."""
    executor = llm.engine.executor
    shapes: dict[int, tuple[int, int]] = {}
    submit = executor.submit

    def recording(request):  # type: ignore[no-untyped-def]
        shapes[request.step_id] = (int(request.step.num_seqs), int(request.step.num_decodes))
        return submit(request)

    executor.submit = recording
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    executor.submit = submit
    time.sleep(0.3)  # the watchers record the last step
    kinds: dict[str, list[float]] = defaultdict(list)
    for t in executor.timings():
        if t.step_id in shapes:
            seqs, decodes = shapes[t.step_id]
            kind = next(name for top, name in BANDS if seqs <= top) if seqs == decodes else "with chunks"
            kinds[kind].append(1e3 * t.forward)
    return wall, kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workload", default="mixed", choices=("mixed", "decode-heavy"))
    p.add_argument("--output-len", type=int, default=256, help="decode-heavy: output tokens per request")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="max_num_seqs; all requests go in one generate")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    from jaxcpp import SamplingParams
    from jaxcpp.models.checkpoint import resolve_model

    prompts, outputs = workload(args, resolve_model(args.model)[0].vocab_size)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outputs]
    max_model_len = MAX_PROMPT[args.workload] + max(outputs)
    engines = {"rungs 8,16,32": build(args, True, max_model_len), "no rungs": build(args, False, max_model_len)}
    walls: dict[str, list[float]] = defaultdict(list)
    steps: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in engines}
    for _ in range(args.repeat):
        for name, llm in engines.items():
            wall, kinds = run_once(llm, prompts, params)
            walls[name].append(wall)
            for kind, ms in kinds.items():
                steps[name][kind] += ms
            print(f"  {name}: {wall:.2f} s", flush=True)
    print(f"\n{'engine':14} {'median s':>9} " + " ".join(f"{k:>18}" for _, k in BANDS) + f" {'with chunks':>18}")
    for name in engines:
        cells = [f"{statistics.median(steps[name][k]):8.2f} ms x{len(steps[name][k]) // args.repeat:<5}"
                 if steps[name][k] else f"{'-':>18}" for k in [*(k for _, k in BANDS), "with chunks"]]
        print(f"{name:14} {statistics.median(walls[name]):9.2f} " + " ".join(cells))
    print("(median device ms of one step, x steps a run, by the sequences a decode-only step carried)")


if __name__ == "__main__":
    main()
