"""Train the bundled byte-level `tiny` Llama on the Python standard library's own source.

Data: every `*.py` under `sysconfig.get_paths()["stdlib"]` (minus site-packages and test suites), in
sorted path order; each file becomes `BOS + utf-8 bytes + EOS`. Every 20th file (index % 20 == 7) is held
out. Training samples random windows with numpy's `default_rng(seed)`; params start from
`jax.random.key(seed)`, so a run is reproducible on the same machine and Python version. The optimiser is
AdamW with linear warm-up and cosine decay. At the end the held-out bits per byte is measured, the
float32 params are saved with orbax (about 3 MB) and a greedy sample is printed.

    .venv/bin/python scripts/train_tiny.py --steps 400 --max-minutes 12

The model is small on purpose: on 2 shared CPU cores a 12-minute budget buys about 1.6M training
tokens, and for that much compute a ~0.8M-parameter model learns more than a 3M one.

`--max-minutes` is a safety cap for shared machines: a run that hits it stops early and says so. The
schedule depends on `--steps` only, so a run stopped after N steps is reproduced exactly by the same
command with `--stop-after-steps N` (and no time pressure).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcpp.models.checkpoint import BUNDLED_MODELS, save_orbax
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.llama import Params, forward_dense, init_params, param_count
from jaxcpp.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()  # bytes 0..255, BOS 256, EOS 257, PAD 258
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT_EVERY, HELD_OUT_INDEX = 20, 7


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=264,  # 256 bytes + BOS/EOS/PAD, padded to a multiple of 8
        hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=TOKENIZER.bos_token_id,
        eos_token_ids=TOKENIZER.eos_token_ids, architecture="LlamaForCausalLM", dtype="float32",
    )


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_streams(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams, uint16: BOS + file bytes + EOS, files concatenated."""
    parts: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for i, path in enumerate(files):
        ids = [TOKENIZER.bos_token_id, *path.read_bytes(), TOKENIZER.eos_token_ids[0]]
        parts[i % HELD_OUT_EVERY == HELD_OUT_INDEX].append(np.asarray(ids, np.uint16))
    return np.concatenate(parts[0]), np.concatenate(parts[1])


def loss_fn(params: Params, batch: jax.Array, config: LlamaConfig) -> jax.Array:
    logits = forward_dense(params, batch[:, :-1], config)  # [B, S, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(config: LlamaConfig, optimizer: optax.GradientTransformation):
    @jax.jit
    def step(params: Params, opt_state: optax.OptState, batch: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def held_out_bits_per_byte(params: Params, config: LlamaConfig, windows: np.ndarray, batch: int) -> float:
    """Mean cross-entropy in bits over held-out targets that are bytes (BOS/EOS targets skipped)."""

    @jax.jit
    def nats(params: Params, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = forward_dense(params, w[:, :-1], config)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:])
        is_byte = w[:, 1:] < ByteTokenizer.NUM_BYTES
        return jnp.sum(jnp.where(is_byte, ce, 0.0)), jnp.sum(is_byte)

    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        s, n = nats(params, jnp.asarray(windows[i:i + batch], jnp.int32))
        total, count = total + float(s), count + int(n)
    return total / count / math.log(2)


def greedy_sample(params: Params, config: LlamaConfig, prompt: str, num_new: int) -> str:
    ids = [TOKENIZER.bos_token_id, *TOKENIZER.encode(prompt)]
    buf = np.full((1, len(ids) + num_new), TOKENIZER.pad_token_id, np.int32)
    buf[0, :len(ids)] = ids
    logits_at = jax.jit(lambda p, b, i: forward_dense(p, b, config)[0, i])  # causal: padding is unseen
    for n in range(len(ids), buf.shape[1]):
        nxt = int(jnp.argmax(logits_at(params, jnp.asarray(buf), n - 1)))
        if nxt in TOKENIZER.eos_token_ids:
            break
        buf[0, n] = nxt
        ids.append(nxt)
    return TOKENIZER.decode(ids[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq-len bytes")
    ap.add_argument("--max-minutes", type=float, default=22.0, help="stop early after this long")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="run only the first N steps of the --steps schedule (reproduces a capped run)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=BUNDLED_MODELS["tiny"])
    ap.add_argument("--sample-prompt", default="def __init__(self")
    args = ap.parse_args()
    t0 = time.time()

    files = stdlib_files()
    train, held_out = build_streams(files)
    print(f"{len(files)} files: {len(train):,} train / {len(held_out):,} held-out tokens", flush=True)
    win = args.seq_len + 1
    eval_starts = np.linspace(0, len(held_out) - win, args.eval_windows).astype(np.int64)
    eval_windows = np.stack([held_out[s:s + win] for s in eval_starts])

    config = tiny_config()
    params = init_params(config, jax.random.key(args.seed), jnp.float32)
    print(f"params: {param_count(params):,}", flush=True)
    warmup = min(args.warmup_steps, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.95, weight_decay=args.weight_decay))
    opt_state = optimizer.init(params)
    step_fn = make_train_step(config, optimizer)
    rng = np.random.default_rng(args.seed)

    steps_done, stopped_early = 0, False
    for step in range(min(args.steps, args.stop_after_steps or args.steps)):
        if time.time() - t0 > args.max_minutes * 60:
            stopped_early = True
            print(f"--max-minutes {args.max_minutes} reached after {step} steps: stopping early", flush=True)
            break
        starts = rng.integers(0, len(train) - win, args.batch_size)
        batch = jnp.asarray(np.stack([train[s:s + win] for s in starts]), jnp.int32)
        params, opt_state, loss = step_fn(params, opt_state, batch)
        steps_done = step + 1
        if step % args.log_every == 0 or steps_done == args.steps:
            print(f"step {step:5d}  loss {float(loss):.4f}  ({float(loss) / math.log(2):.3f} bits/byte)  "
                  f"lr {float(schedule(step)):.2e}  {time.time() - t0:6.0f}s", flush=True)
    train_s = time.time() - t0

    bpb = held_out_bits_per_byte(params, config, eval_windows, args.batch_size)
    print(f"held-out bits/byte: {bpb:.4f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_orbax(args.out, params, config)
    TOKENIZER.save(args.out)
    sample = greedy_sample(params, config, args.sample_prompt, 200)
    info = {
        "command": " ".join(["scripts/train_tiny.py", *sys.argv[1:]]),
        "seed": args.seed, "steps": steps_done, "stopped_early": stopped_early,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "params": param_count(params), "train_tokens": int(len(train)), "held_out_tokens": int(len(held_out)),
        "num_files": len(files), "held_out_bits_per_byte": round(bpb, 4), "train_seconds": round(train_s),
        "python": platform.python_version(), "jax": jax.__version__, "sample_prompt": args.sample_prompt,
        "greedy_sample": sample,
    }
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {args.out}\n--- greedy sample ---\n{sample}", flush=True)


if __name__ == "__main__":
    main()
