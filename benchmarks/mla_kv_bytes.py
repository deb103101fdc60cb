"""KV-cache bytes a token for a DeepSeek-V3-shaped model: the latent cache against per-head K/V caches
of the same model, and the longest prompt one pipeline stage's cache holds, through the engine's own
sizing code (`jaxcpp.core.sizing`: `stage_layers`, `page_bytes`, `pages_in_memory`).

    .venv/bin/python benchmarks/mla_kv_bytes.py [--memory-gb 40] [--pp 4] [--page-size 16]

Arithmetic, not a measurement: no weights, no device.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from jaxcpp.core.sizing import kv_values_per_token, page_bytes, pages_in_memory, stage_layers


@dataclass(frozen=True)
class DeepseekV3Shape:
    """config.json's attention fields of DeepSeek-V3 (Kimi-K2: the same but 64 heads, 61 layers)."""

    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    # What a per-head (MHA) cache of the same model keeps: 128 heads, K 192 wide (the engine's pages
    # today hold K and V at one head_dim, so V would be padded to 192 too).
    num_key_value_heads: int = 128
    head_dim: int = 192


def layouts() -> dict[str, DeepseekV3Shape]:
    v3 = DeepseekV3Shape()
    return {
        "latent (MLA)": v3,
        "per-head K/V, engine layout (V at 192)": dataclasses.replace(v3, kv_lora_rank=0),
    }


def report(memory_gb: float, pp: int, page_size: int) -> str:
    v3 = DeepseekV3Shape()
    largest = max(end - start for start, end in stage_layers(v3.num_hidden_layers, pp))
    exact_mha = v3.num_attention_heads * (v3.qk_nope_head_dim + v3.qk_rope_head_dim + v3.v_head_dim)
    lines = [f"DeepSeek-V3 shape: {v3.num_hidden_layers} layers, PP {pp} (largest stage {largest} layers), "
             f"page {page_size}, {memory_gb:g} GiB of KV cache a stage (--kv-cache-memory-gb {memory_gb:g})",
             "",
             "| cache | dtype | values a token a layer | bytes a token (61 layers) | bytes a token a stage "
             "| pages a stage | longest prompt a stage holds |",
             "|---|---|---|---|---|---|---|"]
    rows = [(name, cfg, kv_values_per_token(cfg)) for name, cfg in layouts().items()]  # type: ignore[arg-type]
    for name, cfg, values in rows:
        for dtype in ("bfloat16", "float8_e4m3fn"):
            model_bytes = page_bytes(cfg, v3.num_hidden_layers, 1, dtype)  # type: ignore[arg-type]
            stage_bytes = page_bytes(cfg, largest, 1, dtype)  # type: ignore[arg-type]
            pages = pages_in_memory(cfg, largest, page_size, dtype, memory_gb)  # type: ignore[arg-type]
            lines.append(f"| {name} | {dtype} | {values} | {model_bytes:,} | {stage_bytes:,} | {pages:,} "
                         f"| {(pages - 1) * page_size:,} tokens |")
    item = 2
    lines.append(f"| per-head K/V, exact (K 192 + V 128; no engine layout) | bfloat16 | {exact_mha} | "
                 f"{exact_mha * item * v3.num_hidden_layers:,} | {exact_mha * item * largest:,} | — | "
                 f"{int(memory_gb * 2**30) // (exact_mha * item * largest):,} tokens |")
    latent = rows[0][2]
    lines += ["", f"Latent vs per-head: {exact_mha / latent:.1f}x fewer bytes than exact K/V "
                  f"({rows[1][2] / latent:.1f}x fewer than the engine's equal-width K/V pages)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gb", type=float, default=40.0)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    print(report(args.memory_gb, args.pp, args.page_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
