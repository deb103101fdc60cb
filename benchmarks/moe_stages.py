"""MoE on stage processes: expert parallelism (TP 2) against TP 1, and dynamic chunking calibrated on an MoE.

    .venv/bin/python benchmarks/moe.py write-models /tmp/moe_models
    .venv/bin/python -P benchmarks/moe_stages.py ep --model /tmp/moe_models/qwen3_moe --rounds 5
    .venv/bin/python -P benchmarks/moe_stages.py calibrate --model /tmp/moe_models/qwen3_moe

`ep`: PP 1 stage process with tensor_parallel_size 1 (one core) against 2 (experts split E/2 per device,
attention heads split, `runtime/sharding.py` shard_experts; two cores), each stage process pinned
(JAXCPP_PIN_STAGE_CORES=1, single-threaded XLA:CPU), both engines kept running in their own processes and
alternated round by round (order rotated), one decode-heavy batch (8 prompts of 32 tokens, 64 new each) and
one prefill-heavy batch (2 prompts of 512 tokens, 1 new each) per round; medians and the median of each
round's ratio. benchmarks/two_core_check.py (alone, then two at once) runs before and after as the control.

`calibrate`: PP 2 stage processes with --enable-dynamic-chunking, calibrated from the stages' own timings
by sole prefills (benchmarks/stage_processes.py's `calibrated_engine`); prints the controller's state, the
installed coefficients and fit error (or why it gave up), then the `jaxcpp chunk-plan` of a long prompt from
them. `--dense` does the same on a dense Qwen3 of the same shape (the MoE's expert MLP replaced by one MLP of
the same width), written by transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def stage_bench():  # type: ignore[no-untyped-def]
    """benchmarks/stage_processes.py, loaded by path (benchmarks/ is kept off sys.path: -P)."""
    spec = importlib.util.spec_from_file_location("stage_processes", HERE / "stage_processes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WORKLOADS = {"decode": (8, 32, 64), "prefill": (2, 512, 1)}   # prompts, prompt tokens, new tokens


def part_ep(args: argparse.Namespace) -> None:
    """One TP configuration, kept running: one timed workload per line read from stdin."""
    from jaxcpp import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", log_stats_interval_s=0, enable_prefix_caching=False,
              max_model_len=640, max_num_batched_tokens=256, max_num_seqs=8, pipeline_parallel_size=1,
              tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    sb = stage_bench()
    batches = {w: ([sb.prompt(n, s) for s in range(k)], SamplingParams(max_tokens=new, ignore_eos=True))
               for w, (k, n, new) in WORKLOADS.items()}
    for prompts, params in batches.values():   # untimed: warms every path
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompts, params = batches[line.strip()]
        first = llm.engine.scheduler.num_steps
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        steps = llm.engine.scheduler.num_steps - first
        print(json.dumps({"seconds": seconds, "steps": steps,
                          "out_tokens": sum(len(o.token_ids) for o in out)}), flush=True)
    llm.engine.close()


class Config:
    def __init__(self, tp: int, args: argparse.Namespace) -> None:
        self.tp, self.rows = tp, {w: [] for w in WORKLOADS}
        env = {**os.environ, "JAXCPP_PIN_STAGE_CORES": "1", "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen([sys.executable, "-P", __file__, "ep-part", "--model", args.model, "--tp",
                                      str(tp)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        t0 = time.perf_counter()
        self.reply()
        print(f"TP {tp} ready in {time.perf_counter() - t0:.0f} s", flush=True)

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
            print("   ", line.rstrip())
        raise RuntimeError(f"TP {self.tp}'s process ended (exit {self.proc.wait()})")

    def run(self, workload: str) -> None:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        self.rows[workload].append(self.reply())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def control(label: str) -> None:
    cmd = [sys.executable, str(HERE / "two_core_check.py")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    alone = subprocess.run([*cmd, "0"], env=env, capture_output=True, text=True).stdout.strip()
    both = [subprocess.Popen([*cmd, c], env=env, stdout=subprocess.PIPE, text=True) for c in ("0", "1")]
    print(f"control {label} (load {os.getloadavg()[0]:.1f}): alone {alone}; two at once "
          f"{[p.communicate()[0].strip() for p in both]}", flush=True)


def ep(args: argparse.Namespace) -> None:
    print(f"# MoE expert parallelism on stage processes, {os.cpu_count()} cores, load {os.getloadavg()}")
    control("before")
    configs = [Config(1, args), Config(2, args)]
    for r in range(args.rounds):
        for c in configs[r % 2:] + configs[:r % 2]:
            for w in WORKLOADS:
                c.run(w)
    for c in configs:
        c.close()
    control("after")
    for w, (k, n, new) in WORKLOADS.items():
        print(f"{w} ({k} prompts x {n} tokens, {new} new each), {args.rounds} alternating rounds:")
        for c in configs:
            rows = c.rows[w]
            s = statistics.median(r["seconds"] for r in rows)
            tok = rows[0]["out_tokens"]
            print(f"  TP {c.tp}: median {s:.3f} s {[round(r['seconds'], 3) for r in rows]}, {tok / s:.1f} output "
                  f"tok/s, {(k * n + tok) / s:.0f} tok/s in+out, {rows[0]['steps']} steps, "
                  f"{s / rows[0]['steps'] * 1e3:.1f} ms/step")
        ratios = [b["seconds"] / a["seconds"] for a, b in zip(configs[0].rows[w], configs[1].rows[w], strict=True)]
        print(f"  TP 2 time / TP 1 time: median of rounds {statistics.median(ratios):.2f} "
              f"{[round(x, 2) for x in ratios]}")
    print(f"load after: {os.getloadavg()}")


def write_dense(moe: str, folder: Path) -> str:
    import torch
    import transformers

    cfg = json.loads((Path(moe) / "config.json").read_text())
    keep = {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "max_position_embeddings", "head_dim")}
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3", **keep, intermediate_size=cfg["moe_intermediate_size"]
                                               * cfg["num_experts_per_tok"], eos_token_id=None, bos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def calibrate(args: argparse.Namespace) -> None:
    import tempfile

    sb = stage_bench()
    model = write_dense(args.model, Path(tempfile.mkdtemp(prefix="dense_"))) if args.dense else args.model
    os.environ["JAXCPP_PIN_STAGE_CORES"] = "1"
    ns = argparse.Namespace(model=model, budget=args.budget, prompt_len=args.prompt_len)
    t0 = time.perf_counter()
    llm, fitted = sb.calibrated_engine(ns, max_model_len=args.prompt_len + 16, max_num_seqs=4,
                                       max_num_batched_tokens=args.budget, pipeline_parallel_size=2,
                                       distributed_executor_backend="mp")
    ctl = llm.engine.chunking
    reason = getattr(ctl.calibrator, "give_up_reason", None)
    print(f"{'dense' if args.dense else 'MoE'} {model}: state {ctl.state}, {time.perf_counter() - t0:.0f} s, "
          f"give-up reason {reason}", flush=True)
    if fitted is not None:
        m = ctl.model
        coeffs = f"{m.a:.4g},{m.b:.4g},{m.c:.4g},{m.gamma:.4g}"
        print(f"installed a,b,c,gamma = {coeffs}; fit error {ctl.fit_error:.4f}", flush=True)
        for long in (args.prompt_len, 4 * args.prompt_len):
            cmd = [str(Path(sys.executable).parent / "jaxcpp"), "chunk-plan", "--prompt-len", str(long),
                   "--coeffs", coeffs, "--fit-error", f"{ctl.fit_error:.4f}", "--max-num-batched-tokens",
                   str(args.budget), "--pipeline-parallel-size", "2", "--dynamic-chunking-min-chunk-size",
                   str(max(64, args.budget // 8))]
            for policy in ("optimal", "equal-latency"):
                print("$", " ".join(cmd[1:]), "--dynamic-chunking-policy", policy, flush=True)
                subprocess.run([*cmd, "--dynamic-chunking-policy", policy])
    llm.engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["ep", "ep-part", "calibrate"])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--dense", action="store_true")
    args = p.parse_args()
    {"ep": ep, "ep-part": part_ep, "calibrate": calibrate}[args.command](args)


if __name__ == "__main__":
    main()
