"""A DeepSeek-V3-shaped engine on PP 2 stage processes: calibration fitting γ, the per-device prefill
rule, and uneven stages. Each stage process is pinned to its own core, single-threaded XLA:CPU
(JAXCPP_PIN_STAGE_CORES=1), as benchmarks/stage_processes.py does.

    .venv/bin/python -P benchmarks/mla_engine.py calibrate [--mla-prefill rebuilt] [--prompt-len 4096]
    .venv/bin/python -P benchmarks/mla_engine.py rule [--budgets 512 1024 2048] [--rounds 3]
    .venv/bin/python -P benchmarks/mla_engine.py stages [--rounds 5] [--prompt-len 4096]

Model: random weights (`jaxcpp.models.llama.init_params`) written as a DeepSeek-V3 folder: q LoRA 384,
kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, YaRN, hidden 1024, 8 heads; MoE layers of 16 experts
top-2 with a shared expert and the grouped sigmoid router; float32. `calibrate`: dense MLP 2048 wide,
experts 256 (benchmarks/mla_model_gamma.py's model); `stages`: dense MLP 1536, experts 512, so that as
in V3 a dense layer's MLP has the FLOPs a token of the MoE's two active experts + shared one.

`calibrate`: 2 layers (one dense, one MoE: one a stage), --enable-dynamic-chunking, budget 512, sole
prefills until calibration ends (benchmarks/stage_processes.py's `calibrated_engine`); prints the
start-up MLA prefill line (the form's weight, measured under auto), the install line (γ beside the fit
with γ forced to 0) or the rejections, and the last fit's errors with and without γ.

`stages`: --dense dense layers then --moe MoE layers (default 3 + 3, as V3's 3 dense layers), a 32K
vocabulary (--vocab), at PP 2, fixed chunks of the budget, prefill absorbed, stacked layer weights.
First the even split runs a long prompt and each stage's model-call time per chunk is read from the
executor's per-stage timings; a layer's cost is its stage's median chunk time over its layers (each
stage of the even split holds one kind of layer here), and the split minimizing the predicted slowest
stage is chosen. Then the even and the chosen engine (both alive) alternate --rounds runs of the long
prompt: TTFT, and each stage's median model-call time per chunk (the bottleneck is the larger).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def stage_bench():  # type: ignore[no-untyped-def]
    """benchmarks/stage_processes.py, loaded by path (benchmarks/ is kept off sys.path: -P)."""
    spec = importlib.util.spec_from_file_location("stage_processes", HERE / "stage_processes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_deepseek(folder: Path, dense: int, moe: int, max_len: int, vocab: int = 1024, mlp: int = 2048,
                   expert: int = 256) -> str:
    import jax

    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import ModelConfig
    from jaxcpp.models.llama import init_params

    config = ModelConfig(
        vocab_size=vocab, hidden_size=1024, intermediate_size=mlp, num_hidden_layers=dense + moe,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=max_len,
        eos_token_ids=(1,), bos_token_id=0, architecture="DeepseekV3ForCausalLM", num_experts=16,
        num_experts_per_tok=2, moe_intermediate_size=expert, norm_topk_prob=True, dense_layers=tuple(range(dense)),
        router="sigmoid", topk_method="group_limited", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        n_shared_experts=1, kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                      "mscale": 1.0, "mscale_all_dim": 1.0})
    save_hf(folder, init_params(config, jax.random.key(0)), config)
    return str(folder)


def calibrate(args: argparse.Namespace) -> None:
    import logging

    sb = stage_bench()
    model = write_deepseek(Path(tempfile.mkdtemp(prefix="deepseek_")), 1, 1, args.prompt_len + 64)
    os.environ["JAXCPP_PIN_STAGE_CORES"] = "1"
    print(f"# calibration on an MLA engine, --mla-prefill {args.mla_prefill}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()}", flush=True)
    ns = argparse.Namespace(model=model, budget=args.budget, prompt_len=args.prompt_len)
    t0 = time.perf_counter()
    logging.getLogger("jaxcpp.runtime.mla_prefill").setLevel(logging.INFO)
    logging.getLogger("jaxcpp.head").setLevel(logging.INFO)
    llm, _ = sb.calibrated_engine(ns, max_model_len=args.prompt_len + 16, max_num_seqs=4,
                                  max_num_batched_tokens=args.budget, pipeline_parallel_size=2,
                                  distributed_executor_backend="mp", mla_prefill=args.mla_prefill)
    ctl = llm.engine.chunking
    cal = ctl.calibrator
    print(f"state {ctl.state} after {time.perf_counter() - t0:.0f} s; planned chunks attend {ctl.prefill_form}; "
          f"{cal.num_shapes} shapes; rebuild weight {llm.engine.executor.mla_rebuild_weight}", flush=True)
    print(f"give-up reason: {cal.give_up_reason}; rejections: {cal.rejections}")
    if cal.last_fit_errors is not None:
        print(f"last fit tried: error {cal.last_fit_errors[0]:.2%} with gamma, {cal.last_fit_errors[1]:.2%} with "
              f"gamma forced to 0")
    by_chunk: dict[int, list[str]] = {}
    for (chunk, prefix), shape in sorted(cal._shapes.items()):
        by_chunk.setdefault(chunk, []).append(f"{prefix}:{shape.median() * 1e3:.0f}")
    for chunk, cells in by_chunk.items():
        print(f"samples, chunk {chunk} (prefix:ms): {' '.join(cells)}")
    print(f"stats: {ctl.stats()}; load after {os.getloadavg()}")
    llm.engine.close()


def rule(args: argparse.Namespace) -> None:
    """--mla-prefill auto's start-up measurement on this device, repeated --rounds times (its noise), for
    the DeepSeek-V3-shaped layer at budgets 512 / 1024 / 2048, and what each rule then rebuilds."""
    import jax

    from jaxcpp.chunking.mla_cost import MlaShape, prefer_rebuild
    from jaxcpp.models.config import ModelConfig
    from jaxcpp.runtime import mla_prefill

    folder = Path(tempfile.mkdtemp(prefix="deepseek_"))
    write_deepseek(folder, 1, 1, 8192)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    shape, device = MlaShape.of(config), jax.devices()[0]
    print(f"# --mla-prefill auto on {device.platform}, {os.cpu_count()} cores, load {os.getloadavg()}")
    for budget in args.budgets:
        for r in range(args.rounds):
            mla_prefill._MEASURED.clear()
            weight = mla_prefill.rebuild_weight("auto", config, device, budget, 16)
            _, how = mla_prefill._MEASURED[next(iter(mla_prefill._MEASURED))]
            chunks = [budget // s for s in mla_prefill.CHUNK_SHARES]
            print(f"budget {budget} round {r}: weight {weight:.3g}; rebuilds after a {budget}-token prefix: auto "
                  f"{[x for x in chunks if prefer_rebuild(shape, budget, x, weight)]}, flops "
                  f"{[x for x in chunks if prefer_rebuild(shape, budget, x)]}; {how}", flush=True)


def split_from_costs(costs: list[float], stages: int = 2) -> list[int]:
    """The 2-stage split (layers per stage, each >= 1) whose slowest stage, by summed layer costs, is
    fastest; ties go to the earlier split."""
    assert stages == 2
    best = min(range(1, len(costs)), key=lambda k: max(sum(costs[:k]), sum(costs[k:])))
    return [best, len(costs) - best]


def run_prompt(llm, tokens: list[int]) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    """TTFT of one lone prompt and each stage's median model-call time over its chunks."""
    sb = stage_bench()
    ex = llm.engine.executor
    before = {(t.step_id, t.stage) for t in ex.timings()}
    ttft = sb.ttft_of(llm, tokens)
    new = [t for t in ex.timings() if (t.step_id, t.stage) not in before and t.traced]
    per_stage = [statistics.median(t.forward for t in new if t.stage == s) for s in range(2)]
    return ttft, per_stage


def stages(args: argparse.Namespace) -> None:
    sb = stage_bench()
    layers = args.dense + args.moe
    model = write_deepseek(Path(tempfile.mkdtemp(prefix="deepseek_")), args.dense, args.moe, args.prompt_len + 64,
                           vocab=args.vocab, mlp=1536, expert=512)
    os.environ["JAXCPP_PIN_STAGE_CORES"] = "1"
    print(f"# uneven stages: {args.dense} dense + {args.moe} MoE layers, PP 2, chunks of {args.budget}, prompt "
          f"{args.prompt_len}; {os.cpu_count()} cores, load {os.getloadavg()}", flush=True)
    base = dict(max_model_len=args.prompt_len + 16, max_num_seqs=4, max_num_batched_tokens=args.budget,
                pipeline_parallel_size=2, distributed_executor_backend="mp", mla_prefill="absorbed",
                layer_weights="stacked")
    long = sb.prompt(args.prompt_len, 3)
    even_split = [layers // 2, layers - layers // 2]
    even = sb.engine(model, pp_partition=",".join(map(str, even_split)), **base)
    run_prompt(even, long)  # untimed: warms every path
    probe = [run_prompt(even, long)[1] for _ in range(3)]
    per_stage = [statistics.median(p[s] for p in probe) for s in range(2)]
    costs = [per_stage[0] / even_split[0]] * even_split[0] + [per_stage[1] / even_split[1]] * even_split[1]
    chosen_split = split_from_costs(costs)
    print(f"even split {even_split}: stage model-call ms per chunk {[round(x * 1e3, 1) for x in per_stage]}; layer "
          f"costs (ms) {[round(c * 1e3, 1) for c in costs]} -> chosen split {chosen_split}, predicted stages "
          f"{[round(sum(costs[:chosen_split[0]]) * 1e3, 1), round(sum(costs[chosen_split[0]:]) * 1e3, 1)]} ms",
          flush=True)
    if chosen_split == even_split:
        print("the even split is already the best by these costs: nothing to compare")
        return
    engines = {"even": even, "chosen": sb.engine(model, pp_partition=",".join(map(str, chosen_split)), **base)}
    run_prompt(engines["chosen"], long)
    rows: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in sb.rotated(list(engines), r):
            rows[name].append(run_prompt(engines[name], long))
    splits = {"even": even_split, "chosen": chosen_split}
    for name, runs in rows.items():
        ttft = statistics.median(t for t, _ in runs)
        st = [statistics.median(p[s] for _, p in runs) for s in range(2)]
        print(f"{name} {splits[name]}: TTFT median {ttft:.3f} s {[round(t, 3) for t, _ in runs]}; stage ms per chunk "
              f"{[round(x * 1e3, 1) for x in st]}, bottleneck {max(st) * 1e3:.1f} ms", flush=True)
    ratios = [c[0] / e[0] for e, c in zip(rows["even"], rows["chosen"], strict=True)]
    print(f"chosen TTFT / even TTFT: median of rounds {statistics.median(ratios):.3f} {[round(x, 3) for x in ratios]}; "
          f"load after {os.getloadavg()}")
    for llm in engines.values():
        llm.engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--mla-prefill", default="rebuilt", choices=("auto", "flops", "absorbed", "rebuilt"))
    c.add_argument("--prompt-len", type=int, default=4096)
    c.add_argument("--budget", type=int, default=512)
    r = sub.add_parser("rule")
    r.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    r.add_argument("--rounds", type=int, default=3)
    s = sub.add_parser("stages")
    s.add_argument("--dense", type=int, default=3)
    s.add_argument("--moe", type=int, default=3)
    s.add_argument("--prompt-len", type=int, default=4096)
    s.add_argument("--budget", type=int, default=512)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--vocab", type=int, default=32768, help="LM head width (V3: 129,280)")
    args = p.parse_args()
    sys.setrecursionlimit(10000)
    {"calibrate": calibrate, "rule": rule, "stages": stages}[args.part](args)


if __name__ == "__main__":
    main()
