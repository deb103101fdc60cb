"""FP8 KV cache and FP8 weights against the full-precision engine: accuracy, and pages per memory.

    .venv/bin/python benchmarks/fp8_accuracy.py                      # both tables, markdown
    .venv/bin/python benchmarks/fp8_accuracy.py --windows 64 --continuations 8 --models tiny

Accuracy, per model and per variant (fp8_e4m3 cache, fp8_e5m2 cache, fp8 weights, fp8 weights + e4m3
cache), all through the engine (paged cache, chunked prefill) on the CPU backend in float32:

- bits per byte: `--windows` evenly spaced windows of `--window` tokens of the held-out text (the Python
  standard library files `scripts/train_tiny.py` held out: index % 20 == 7, each BOS + bytes + EOS),
  scored with prompt logprobs; targets that are bytes only, as in training's measure.
- greedy agreement over `--new-tokens` tokens: the full-precision engine continues `--continuations`
  held-out prompts greedily; the variant reads prompt + that continuation (teacher-forced) and we count
  the positions where its most likely token is the full-precision one. Also the free-running share:
  the variant's own greedy continuation, position by position.
- mean |delta logprob|: over those continuation tokens, |variant's log p(token) - full precision's|.

The random Llama (`--random-*`: its weights x3, so its predictions are not flat) reads the same bytes.

Memory: the pages `EngineSizing.plan` (the engine's own sizing) gives at the same --kv-cache-memory-gb
for bfloat16 and fp8 pages, and the longest prompt those pages hold, for the bundled model and for a
70B-class config (Llama-3-70B shape: 80 layers, 8 KV heads of 128, PP=4 so 20 layers per stage).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxcpp import LLM, SamplingParams
from jaxcpp.config import EngineConfig
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.models.spec import resolve_model_spec
from jaxcpp.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT_EVERY, HELD_OUT_INDEX = 20, 7  # scripts/train_tiny.py's split
VARIANTS = {
    "full precision (float32)": {},
    "fp8_e4m3 KV cache": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2 KV cache": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8_e4m3 KV cache, --calculate-kv-scales": {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 weights + fp8_e4m3 cache": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}
ENGINE = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16,
              log_stats_interval_s=0)


def held_out_stream() -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    parts = [np.asarray([TOKENIZER.bos_token_id, *p.read_bytes(), TOKENIZER.eos_token_ids[0]], np.int32)
             for i, p in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_INDEX]
    return np.concatenate(parts)


def windows(stream: np.ndarray, count: int, length: int, offset: int = 0) -> list[list[int]]:
    starts = np.linspace(offset, len(stream) - length - 1, count).astype(int)
    return [[int(t) for t in stream[s:s + length]] for s in starts]


def bits_per_byte(llm: LLM, prompts: list[list[int]]) -> float:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    nats, count = 0.0, 0
    for out in outs:
        assert out.prompt_logprobs is not None
        for lp in out.prompt_logprobs:
            if lp.token_id < ByteTokenizer.NUM_BYTES:
                nats, count = nats - lp.logprob, count + 1
    return nats / count / math.log(2)


def continuation_scores(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """Teacher-forced: each continuation position's most likely token and the continuation token's logprob."""
    outs = llm.generate(prompt_token_ids=[p + c for p, c in zip(prompts, continuations, strict=True)],
                        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1))
    top, logprobs = [], []
    for p, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None
        tail = out.prompt_logprobs[len(p) - 1:]  # entry i scores prompt token i + 1
        top.append([lp.top[0][0] for lp in tail])
        logprobs.append([lp.logprob for lp in tail])
    return top, logprobs


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def accuracy_rows(model: str, args: argparse.Namespace, stream: np.ndarray) -> list[dict]:
    scored = windows(stream, args.windows, args.window)
    prompts = windows(stream, args.continuations, args.prompt_len, offset=args.window // 2)
    rows, base = [], None
    for name, flags in VARIANTS.items():
        start = time.perf_counter()
        with LLM(model=model, **ENGINE, **flags) as llm:
            row = {"model": model, "variant": name, "bits_per_byte": bits_per_byte(llm, scored)}
            free = greedy(llm, prompts, args.new_tokens)
            if base is None:
                base = {"bpb": row["bits_per_byte"], "greedy": free}
                _, base["logprobs"] = continuation_scores(llm, prompts, free)
            top, logprobs = continuation_scores(llm, prompts, base["greedy"])
        want = np.concatenate(base["greedy"])
        row["delta_bpb_pct"] = 100 * (row["bits_per_byte"] / base["bpb"] - 1)
        row["teacher_forced_agreement"] = float(np.mean(np.concatenate(top) == want))
        row["free_running_agreement"] = float(np.mean(np.concatenate(free) == want))
        row["mean_abs_delta_logprob"] = float(np.mean(np.abs(np.concatenate(logprobs)
                                                             - np.concatenate(base["logprobs"]))))
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def write_random_llama(folder: Path, args: argparse.Namespace) -> str:
    import jax

    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params

    config = LlamaConfig(vocab_size=264, hidden_size=args.random_hidden, intermediate_size=3 * args.random_hidden,
                         num_hidden_layers=args.random_layers, num_attention_heads=args.random_hidden // 32,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=TOKENIZER.bos_token_id, eos_token_ids=TOKENIZER.eos_token_ids)
    params = init_params(config, jax.random.key(args.seed))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    save_hf(folder, params, config)
    return str(folder)


def write_config(folder: Path, **fields: object) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                     "torch_dtype": "bfloat16", **fields}))
    return str(folder)


def memory_rows(tmp: Path) -> list[dict]:
    llama70b = write_config(tmp / "llama70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                            num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=131072)
    cases = [("tiny (bundled)", "tiny", 1, 1.0), ("Llama-3-70B shape, PP=4", llama70b, 4, 40.0)]
    rows = []
    for label, model, pp, memory_gb in cases:
        for kv in ("auto", "fp8"):
            config = EngineConfig.from_kwargs(model=model, kv_cache_dtype=kv, kv_cache_memory_gb=memory_gb,
                                              pipeline_parallel_size=pp, max_model_len=2048,
                                              max_num_batched_tokens=4096, max_num_seqs=4096)
            sizing = EngineSizing.plan(config, resolve_model_spec(model, "bfloat16"))
            rows.append({"model": label, "kv_cache_memory_gb": memory_gb, "kv_cache_dtype": sizing.kv_cache_dtype,
                         "pages": sizing.num_pages, "longest_prompt_tokens": (sizing.num_pages - 1) * sizing.page_size})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,random", help="tiny and/or random")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--continuations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--random-hidden", type=int, default=256)
    ap.add_argument("--random-layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    stream = held_out_stream()
    with tempfile.TemporaryDirectory() as tmp:
        print("| model | --kv-cache-memory-gb | pages hold | pages per stage | longest prompt (tokens) |")
        print("| --- | ---: | --- | ---: | ---: |")
        for r in memory_rows(Path(tmp)):
            print(f"| {r['model']} | {r['kv_cache_memory_gb']:g} | {r['kv_cache_dtype']} | {r['pages']:,} | "
                  f"{r['longest_prompt_tokens']:,} |")
        if args.skip_accuracy:
            return
        rows = []
        for model in args.models.split(","):
            path = "tiny" if model == "tiny" else write_random_llama(Path(tmp) / "random", args)
            rows += accuracy_rows(path, args, stream)
    print(f"\n{args.windows} windows x {args.window} tokens; {args.continuations} continuations x "
          f"{args.new_tokens} tokens\n")
    print("| model | variant | bits/byte | vs full | greedy agreement (teacher-forced) | "
          "greedy agreement (free-running) | mean abs delta logprob |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        name = "tiny" if r["model"] == "tiny" else "random Llama"
        print(f"| {name} | {r['variant']} | {r['bits_per_byte']:.4f} | {r['delta_bpb_pct']:+.2f}% | "
              f"{r['teacher_forced_agreement']:.4f} | {r['free_running_agreement']:.4f} | "
              f"{r['mean_abs_delta_logprob']:.5f} |")


if __name__ == "__main__":
    main()
