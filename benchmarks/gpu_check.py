"""Everything that needs a GPU, in one command, for the day one is at hand (NVIDIA or AMD):

    make gpu-check                     # = python3 benchmarks/gpu_check.py --out out/gpu-check
    python3 benchmarks/gpu_check.py --out DIR [--budget-s 480]

Meant for a machine that already has a GPU build of jax and may have no network: it installs nothing.
This checkout goes on the path as the install lays it out (a folder of links that maps models/,
kernels/ and serving/ into the `jaxcpp` package), whatever the environment has installed.

    1. kernel tests compiled, not interpreted (tests/kernels: the Triton-lowered Pallas kernel)
    2. benchmarks/kernels.py: the Pallas kernel against the XLA path on decode-heavy, prefill-heavy and
       mixed batches, beside the device's measured matmul rate and copy bandwidth
    3. the engine on a random Llama-3.2-1B-shaped model in bfloat16: TTFT of a 4096-token prompt, TPOT
       of one stream and of 32, and compilations after warm-up (must be 0)
Each part runs in its own process with its share of --budget-s (8 minutes in all by default); one JSON
(gpu_check.json) and one Markdown table (gpu_check.md) land in --out. Without a GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"models": "models", "kernels": "kernels", "serving": "serving"}  # jaxcpp.X <- folder


def importable_env() -> dict[str, str]:
    """The environment for the parts: PYTHONPATH starts with a `jaxcpp` package laid out as the install
    lays it out (links into this checkout), so nothing needs installing and this checkout is what runs."""
    site = Path(tempfile.mkdtemp(prefix="jaxcpp_path_"))
    package = site / "jaxcpp"
    package.mkdir()
    for entry in (REPO / "jaxcpp").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in SUBPACKAGES.items():
        (package / name).symlink_to(REPO / folder)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "JAX_PLATFORMS": ""}  # "": the GPU, not the CPU the test suite asks for


def gpu_backend() -> str | None:
    """The GPU platform jax sees ('gpu' for CUDA and ROCm builds), or None."""
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": ""})
    backend = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "none"
    return backend if backend in ("gpu", "cuda", "rocm") else None


def run(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, the output, seconds)."""
    start = time.perf_counter()
    try:  # run from outside the checkout: its own jaxcpp/ folder would shadow the mapped package
        res = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                             timeout=timeout_s)
        return res.returncode, res.stdout + res.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() + (e.stderr or b"").decode() if isinstance(e.stdout, bytes) else ""
        return None, out, time.perf_counter() - start


def kernel_tests(env: dict[str, str], timeout_s: float) -> dict:
    code, out, seconds = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
                              f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"), str(REPO / "tests/kernels")],
                             env, timeout_s)
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line), "")
    return {"ok": code == 0, "summary": summary.strip("= "), "seconds": round(seconds, 1),
            "tail": out.splitlines()[-15:] if code != 0 else []}


def kernel_benchmark(env: dict[str, str], timeout_s: float) -> dict:
    code, out, seconds = run([sys.executable, str(REPO / "benchmarks/kernels.py"), "--iters", "10"], env, timeout_s)
    lines = out.splitlines()
    scenarios = ("decode-heavy", "prefill-heavy", "mixed")
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in scenarios]
    peaks = next((line for line in lines if line.startswith("measured peaks")), "")
    device = next((line for line in lines if line.startswith("device:")), "")
    return {"ok": code == 0, "device": device, "peaks": peaks, "rows": rows, "seconds": round(seconds, 1),
            "tail": lines[-15:] if code != 0 else []}


ENGINE_PART = r'''
import json, statistics, sys, tempfile, time
from pathlib import Path
import jax, numpy as np
from jaxcpp import LLM, SamplingParams
from jaxcpp.models.checkpoint import save_hf
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.llama import init_params

small = len(sys.argv) > 1 and sys.argv[1] == "--small"
config = LlamaConfig(vocab_size=128256 if not small else 512, hidden_size=2048 if not small else 64,
                     intermediate_size=8192 if not small else 128, num_hidden_layers=16 if not small else 2,
                     num_attention_heads=32 if not small else 4, num_key_value_heads=8 if not small else 2,
                     head_dim=64 if not small else 16, max_position_embeddings=8192, tie_word_embeddings=True,
                     eos_token_ids=(1,), bos_token_id=0, dtype="bfloat16")
folder = Path(tempfile.mkdtemp(prefix="jaxcpp_1b_"))
t0 = time.perf_counter()
params = init_params(config, jax.random.key(0), jax.numpy.bfloat16)
num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
save_hf(folder, params, config)
del params
written = time.perf_counter() - t0
t0 = time.perf_counter()
llm = LLM(model=str(folder), dtype="bfloat16" if not small else "float32", max_model_len=8192,
          max_num_batched_tokens=2048 if not small else 256, max_num_seqs=64,
          kv_cache_memory_gb=8 if not small else 0.05, enable_prefix_caching=False, log_stats_interval_s=0)
ready = time.perf_counter() - t0
rng = np.random.default_rng(0)
def prompts(n, length):
    return [[int(t) for t in rng.integers(2, config.vocab_size, length)] for _ in range(n)]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
plen = 4096 if not small else 256
llm.generate(prompt_token_ids=prompts(1, plen), sampling_params=greedy(8))  # untimed
ttft = [llm.generate(prompt_token_ids=prompts(1, plen), sampling_params=greedy(1))[0].metrics.ttft for _ in range(3)]
def tpot(batch, n=128 if not small else 8):
    outs = llm.generate(prompt_token_ids=prompts(batch, 128), sampling_params=greedy(n))
    return statistics.median((o.metrics.e2e - o.metrics.ttft) / (len(o.token_ids) - 1) for o in outs)
tpot1, tpot32 = tpot(1), tpot(32 if not small else 4)
stats = llm.engine.stats()
print(json.dumps({"params": int(num_params), "write_checkpoint_s": round(written, 1),
                  "start_to_ready_s": round(ready, 1), "warmup_s": round(llm.engine.warmup_seconds, 1),
                  "buckets": len(llm.engine.sizing.token_buckets), "prompt_len": plen,
                  "ttft_s": [round(t, 4) for t in ttft], "ttft_median_s": round(statistics.median(ttft), 4),
                  "tpot_1_ms": round(tpot1 * 1e3, 3), "tpot_32_ms": round(tpot32 * 1e3, 3),
                  "compilations_after_warmup": stats.num_compilations_since_warmup,
                  "device": str(jax.devices()[0].device_kind)}))
llm.close()
'''


def engine_run(env: dict[str, str], timeout_s: float, small: bool) -> dict:
    code, out, seconds = run([sys.executable, "-c", ENGINE_PART, *(["--small"] if small else [])], env, timeout_s)
    result = next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")), None)
    return {"ok": code == 0 and result is not None and result["compilations_after_warmup"] == 0,
            "seconds": round(seconds, 1), **(result or {}), "tail": out.splitlines()[-15:] if code != 0 else []}


def markdown(report: dict) -> str:
    k, b, e = report["kernel_tests"], report["kernel_benchmark"], report["engine"]
    lines = [f"# GPU check: {report['device']}", "",
             f"jax {report['jax']}, backend {report['backend']}, {report['seconds']:.0f} s in all", "",
             "| part | result | seconds |", "| --- | --- | --- |",
             f"| kernel tests, compiled | {'ok' if k['ok'] else 'FAILED'}: {k['summary']} | {k['seconds']} |",
             f"| kernels.py | {'ok' if b['ok'] else 'FAILED'}: {b['peaks']} | {b['seconds']} |",
             f"| engine, random ~1B Llama, bfloat16 | {'ok' if e['ok'] else 'FAILED'}: TTFT "
             f"{e.get('ttft_median_s')} s ({e.get('prompt_len')} tokens), TPOT {e.get('tpot_1_ms')} ms (1 stream) "
             f"/ {e.get('tpot_32_ms')} ms (32), {e.get('compilations_after_warmup')} compilations after warm-up, "
             f"warm-up {e.get('warmup_s')} s for {e.get('buckets')} buckets | {e['seconds']} |", ""]
    if b["rows"]:
        lines += ["```", *b["rows"], "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu-check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all three parts")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a GPU, run the engine part with a tiny float32 model (checks this script; "
                             "measures nothing)")
    args = parser.parse_args()
    backend = gpu_backend()
    if backend is None and not args.allow_cpu:
        print("gpu-check: no GPU here (jax's default backend is not a GPU); nothing to check")
        return 0
    start = time.perf_counter()
    env = importable_env()
    report: dict = {"backend": backend or "cpu"}
    describe = "import jax; print(jax.__version__); print(jax.devices()[0].device_kind)"
    info = subprocess.run([sys.executable, "-c", describe], capture_output=True, text=True, env=env).stdout.split("\n")
    report["jax"], report["device"] = info[0], info[1] if len(info) > 1 else "?"
    if backend is None:  # --allow-cpu: only the engine part, tiny, to check the script itself
        report["kernel_tests"] = {"ok": True, "summary": "skipped (no GPU)", "seconds": 0}
        report["kernel_benchmark"] = {"ok": True, "peaks": "skipped (no GPU)", "rows": [], "seconds": 0}
        report["engine"] = engine_run(env, args.budget_s, small=True)
    else:
        report["kernel_tests"] = kernel_tests(env, 0.25 * args.budget_s)
        report["kernel_benchmark"] = kernel_benchmark(env, 0.25 * args.budget_s)
        report["engine"] = engine_run(env, args.budget_s - (time.perf_counter() - start) - 5, small=False)
    report["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    ok = all(report[part]["ok"] for part in ("kernel_tests", "kernel_benchmark", "engine"))
    print(f"gpu-check: {'ok' if ok else 'FAILED'}; wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
