"""Offline throughput: jaxcpp's `LLM.generate` against Hugging Face `generate` on the same weights.

Three workloads: `mixed` (prompts 32-1024 tokens, outputs 16-256), `decode-heavy` (16-token prompts,
`--output-len` tokens each) and `prompt-heavy` (1024-token prompts, `--output-len` tokens each), in
batches of `--batch-size` for both engines. jaxcpp compiles every
bucket at start-up and runs each once; that time is reported apart from the generation time. HF is
warmed up too (its first batch, untimed) before it is timed. HF runs each batch
left-padded, greedy, to the batch's longest output (its `generate` cannot stop rows separately without
wasting their slots), and only the tokens each request asked for are counted for either engine.
jaxcpp's padding share (padded tokens over all tokens its steps ran) is printed too, and with
`--price-decode-ladders` what it would have been with other rungs below the token buckets (the schedule
does not depend on them, so the recorded steps price any ladder).

    .venv/bin/python benchmarks/offline_throughput.py --num-requests 64 --model tiny
    .venv/bin/python benchmarks/offline_throughput.py --workload decode-heavy --batch-size 64 --skip-hf \
        --baseline main --repeat 3      # jaxcpp now vs its attention path and ladder at `main`, alternating
    git worktree add /tmp/old 6b900d7   # then: jaxcpp now against that commit's whole package, alternating
    .venv/bin/python benchmarks/offline_throughput.py --workload prompt-heavy --num-requests 32 --output-len 16 \
        --batch-size 32 --skip-hf --checkout /tmp/old --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MAX_PROMPT = {"mixed": 1024, "decode-heavy": 16, "prompt-heavy": 1024}


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    if args.workload == "decode-heavy":
        return [rng.integers(3, min(vocab, 256), 16).tolist() for _ in range(n)], [args.output_len] * n
    if args.workload == "prompt-heavy":
        return [rng.integers(3, min(vocab, 256), 1024).tolist() for _ in range(n)], [args.output_len] * n
    prompts = [rng.integers(3, min(vocab, 256), int(rng.integers(32, 1025))).tolist() for _ in range(n)]
    outputs = [int(x) for x in rng.integers(16, 257, n)]
    return prompts, outputs


def record_step_tokens(llm) -> list[tuple[int, int, bool]]:
    """(real tokens, padded tokens, may take a rung) of every step the engine submits from now on."""
    steps: list[tuple[int, int, bool]] = []
    submit = llm.engine.executor.submit

    def recording_submit(request):
        step = request.step
        on_rungs = bool((step.prompt_targets < 0).all())  # scores no prompt token (`step_bucket`)
        steps.append((int(step.cu_q_lens[-1]), step.num_tokens_padded, on_rungs))  # padding repeats the end
        return submit(request)

    llm.engine.executor.submit = recording_submit
    return steps


def use_attention_at(revision: str) -> None:
    """Make the engine's "xla" backend the XLA attention path as it was at `revision`."""
    from baseline import module_at_revision

    import jaxcpp.kernels.backend as backend

    old = module_at_revision("kernels/ragged_paged_attention.py", revision)
    backend.ragged_paged_attention_xla = old.ragged_paged_attention_xla


def stub_attention() -> None:
    """Make the "xla" attention the identity on q: what is left is the step's cost outside attention
    (the tokens are then not the model's; only the timing means anything)."""
    import jaxcpp.kernels.backend as backend

    backend.ragged_paged_attention_xla = lambda q, k_pages, v_pages, md, **_: q


def run_jaxcpp(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    from jaxcpp import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.batch_size, max_model_len=MAX_PROMPT[args.workload] + max(outputs),
              log_stats_interval_s=0)
    startup = time.perf_counter() - t0
    steps = record_step_tokens(llm)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outputs]
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        llm.generate(prompt_token_ids=prompts[i:i + args.batch_size], sampling_params=params[i:i + args.batch_size])
    elapsed = time.perf_counter() - t0
    real, padded = sum(r for r, _, _ in steps), sum(p for _, p, _ in steps)
    return {"startup_s": startup, "compile_s": llm.engine.warmup_seconds, "generate_s": elapsed,
            "output_tok_s": sum(outputs) / elapsed, "total_tok_s": (sum(outputs) + sum(map(len, prompts))) / elapsed,
            "steps": len(steps), "padding_share": (padded - real) / padded, "step_tokens": steps}


def run_hf(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxcpp.models.checkpoint import resolve_model, save_hf

    torch.set_num_threads(os.cpu_count() or 1)
    config, params, _ = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, params, config)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    pad = 0

    def generate(batch: list[list[int]], max_new_tokens: int) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                           max_new_tokens=max_new_tokens, min_new_tokens=1, eos_token_id=None)

    # Warm up as jaxcpp's start-up does (its buckets are compiled and run once before timing): a
    # process's first full-length generate pays one-time costs that a server never pays again (a short
    # one does not: measured, the first timed run stayed ~1.7x slower than the next on decode-heavy).
    generate(prompts[:args.batch_size], max(outputs[:args.batch_size]))
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        generate(prompts[i:i + args.batch_size], max(outputs[i:i + args.batch_size]))
    elapsed = time.perf_counter() - t0
    return {"generate_s": elapsed, "output_tok_s": sum(outputs) / elapsed,
            "total_tok_s": (sum(outputs) + sum(map(len, prompts))) / elapsed}


def run_variant(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int],
                revision: str | None, checkout: str | None = None) -> dict:
    """One jaxcpp run in a fresh process (so a baseline's attention path cannot leak into the other)."""
    spec = {"args": vars(args), "revision": revision, "checkout": checkout}
    cmd = [sys.executable, __file__, "--jaxcpp-child", json.dumps(spec)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout  # its log and errors: ours
    return json.loads(out.strip().splitlines()[-1])


def import_package_from(checkout: str) -> None:
    """Make `jaxcpp` (and its jaxcpp.models / kernels / serving folders) import from another checkout of
    the project: a finder ahead of the venv's editable install, so a bisect needs no venv per commit."""
    import importlib.util
    from pathlib import Path

    folders = {"jaxcpp": "jaxcpp", "jaxcpp.kernels": "kernels", "jaxcpp.models": "models", "jaxcpp.serving": "serving"}

    class CheckoutFinder:
        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> object:
            if name not in folders:
                return None
            folder = Path(checkout, folders[name])
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, CheckoutFinder)


def jaxcpp_child(spec: str) -> None:
    spec = json.loads(spec)
    args = argparse.Namespace(**spec["args"])
    if spec.get("checkout"):
        import_package_from(spec["checkout"])
    if spec["revision"]:
        from baseline import use_ladder_at

        use_attention_at(spec["revision"])
        use_ladder_at(spec["revision"])
    if args.stub_attention:
        stub_attention()
    from jaxcpp.models.checkpoint import resolve_model

    prompts, outputs = workload(args, resolve_model(args.model)[0].vocab_size)
    print(json.dumps(run_jaxcpp(args, prompts, outputs)))


def price_decode_ladders(run: dict, ladders: list[list[int]], args: argparse.Namespace) -> None:
    """The recorded steps' padding share on the token buckets with each ladder of rungs below them."""
    from jaxcpp.core.buckets import padding_share, token_buckets

    real = [n for n, _, _ in run["step_tokens"]]
    on_rungs = [d for _, _, d in run["step_tokens"]]
    buckets = token_buckets(args.max_num_batched_tokens, 16)
    for rungs in ladders:
        rungs = [r for r in rungs if r < buckets[0]]
        share = padding_share(real, buckets, on_rungs=on_rungs, decode_rungs=rungs)
        print(f"  rungs {rungs or 'none'}: padding share {100 * share:.1f}% "
              f"({len(rungs) + len(buckets)} programs)")


def median_run(runs: list[dict]) -> dict:
    """The run with the median generate time (its other figures come with it)."""
    return sorted(runs, key=lambda r: r["generate_s"])[len(runs) // 2]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--jaxcpp-child":
        jaxcpp_child(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workload", default="mixed", choices=tuple(MAX_PROMPT))
    p.add_argument("--output-len", type=int, default=256, help="decode- and prompt-heavy: output tokens per request")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--baseline", metavar="REV",
                   help="also run jaxcpp with the XLA attention path and the bucket ladder of git revision REV "
                        "(alternating)")
    p.add_argument("--checkout", nargs="*", default=[], metavar="DIR",
                   help="also run jaxcpp as the whole package in these checkouts (e.g. `git worktree add DIR REV`), "
                        "alternating: a bisect over commits")
    p.add_argument("--price-decode-ladders", nargs="*", default=[], metavar="RUNGS",
                   help="also price the recorded steps with these rungs below the token buckets, "
                        "e.g. 8,16,32 16,32 none")
    p.add_argument("--stub-attention", action="store_true",
                   help="jaxcpp with attention replaced by the identity: the step's cost outside attention")
    p.add_argument("--repeat", type=int, default=1, help="runs per engine, alternating; medians are printed")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    from jaxcpp.models.checkpoint import resolve_model

    vocab = resolve_model(args.model)[0].vocab_size
    prompts, outputs = workload(args, vocab)
    print(f"workload {args.workload}: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))} "
          f"(median {statistics.median(map(len, prompts)):.0f}), output tokens {sum(outputs)}, "
          f"batches of {args.batch_size}")
    variants = {"jaxcpp": None, **({f"jaxcpp@{args.baseline}": args.baseline} if args.baseline else {})}
    checkouts = {f"jaxcpp@{os.path.basename(d.rstrip('/'))}": os.path.abspath(d) for d in args.checkout}
    runs: dict[str, list[dict]] = {name: [] for name in [*variants, *checkouts, *([] if args.skip_hf else ["hf"])]}
    for _ in range(args.repeat):  # alternate, so load on the machine falls on every engine alike
        for name in runs:
            if name == "hf":
                run = run_hf(args, prompts, outputs)
            elif name in checkouts:
                run = run_variant(args, prompts, outputs, None, checkouts[name])
            else:
                run = run_variant(args, prompts, outputs, variants[name])
            runs[name].append(run)
            print(f"  {name}: {run['output_tok_s']:.1f} output tok/s ({run['generate_s']:.1f}s)")
    results = {name: median_run(rs) for name, rs in runs.items()}
    width = max(8, *map(len, results))
    print(f"{'engine':{width}} {'generate s':>11} {'output tok/s':>13} {'total tok/s':>12}")
    for name, r in results.items():
        print(f"{name:{width}} {r['generate_s']:11.1f} {r['output_tok_s']:13.1f} {r['total_tok_s']:12.1f}")
    j = results["jaxcpp"]
    print(f"jaxcpp start-up {j['startup_s']:.1f}s, of which compiling every bucket {j['compile_s']:.1f}s; "
          f"{j['steps']} steps, padding share {100 * j['padding_share']:.1f}% of the tokens they ran")
    if args.price_decode_ladders:
        price_decode_ladders(j, [[] if r == "none" else [int(x) for x in r.split(",")]
                                 for r in args.price_decode_ladders], args)
    if "hf" in results:
        print(f"ratio jaxcpp / HF output tokens/s (medians of {args.repeat}): "
              f"{j['output_tok_s'] / results['hf']['output_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
