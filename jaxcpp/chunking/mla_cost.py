"""FLOPs of MLA attention (DeepSeek-V2/V3, Kimi-K2) in its two forms, the rule that picks one for a
prefill chunk, and the latency-model terms that follow. Host-side: no jax.

A layer caches one latent row a token (c, `kv_lora_rank` r wide, and the shared roped key, `dr` wide).
kv_b_proj maps c to every head's k_nope (dn) and v (dv): W = 2·r·H·(dn + dv) FLOPs a token.

- absorbed: queries go into the latent space (q_nope @ W_UK, per head) and the latent output back
  (@ W_UV): W per NEW token; a visible (query, key) pair costs 2·H·(2r + dr) (scores over r + dr, output
  over r).
- rebuilt: every CONTEXT token's K/V is rebuilt from its latent once a chunk: W·(L + x); a pair costs
  2·H·(dn + dr + dv), the ordinary attention of the rebuilt heads.

Both pay W·x for the chunk's own tokens, so rebuilding costs W·L more and saves (pair_a − pair_r) per
pair; a chunk of x after L cached tokens sees L·x + x·(x + 1)/2 pairs. Rebuilding wins once
W·L < (pair_a − pair_r)·(L·x + x(x+1)/2): for L ≫ x at x > r·(dn + dv) / (2r − dn − dv), whatever H is:
170.7 tokens for DeepSeek-V3 (512·256 / 768), and always at L = 0. vLLM rebuilds every prefill chunk;
SGLang switches on the prefix length; `prefer_rebuild` below is the FLOP rule, and as the chunks the
engine plans are far above the crossover (>= 64 tokens is the alignment, 4096 the usual minimum), the
latency model of an MLA model is the rebuilt form's: γ = W per cached token, a = pair_r / 2 per unit of
2·L·x + x² (`latency_terms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxcpp.chunking.planner import positive_root

FORMS = ("absorbed", "rebuilt")


@dataclass(frozen=True)
class MlaShape:
    """The attention head layout of an MLA model (config.json's names)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"MlaShape.{name} must be a positive integer, got {value!r}")

    @staticmethod
    def deepseek_v3() -> MlaShape:
        """DeepSeek-V3 / Kimi-K2's per-head layout with V3's 128 heads (Kimi-K2: 64)."""
        return MlaShape(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

    @property
    def latent_width(self) -> int:
        """Values a token a layer in a latent page: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_flops(self) -> float:
        """W: kv_b_proj on one token (absorbing a query and projecting an output back cost the same)."""
        return 2.0 * self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    def pair_flops(self, form: str) -> float:
        """FLOPs of one visible (query, key) pair over all heads in `form`."""
        if form == "absorbed":
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        if form == "rebuilt":
            return 2.0 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def causal_pairs(prefix_len: float, chunk: float) -> float:
    """(query, key) pairs a chunk of `chunk` tokens after `prefix_len` cached ones sees."""
    return prefix_len * chunk + chunk * (chunk + 1) / 2.0


def attention_flops(shape: MlaShape, prefix_len: float, chunk: float, form: str) -> float:
    """FLOPs of one layer's MLA attention for a chunk (projections of q/kv into the latent excluded)."""
    rebuilt_tokens = prefix_len + chunk if form == "rebuilt" else chunk
    return shape.kv_b_flops * rebuilt_tokens + shape.pair_flops(form) * causal_pairs(prefix_len, chunk)


def prefer_rebuild(shape: MlaShape, prefix_len: float, chunk: float) -> bool:
    """The per-chunk choice: rebuild the prefix when that costs fewer FLOPs than attending absorbed."""
    return attention_flops(shape, prefix_len, chunk, "rebuilt") < attention_flops(shape, prefix_len, chunk, "absorbed")


def crossover_chunk(shape: MlaShape, prefix_len: float) -> float:
    """The chunk length above which rebuilding is cheaper after `prefix_len` cached tokens (real-valued;
    inf when it never is): the root of W·L = Δ·(L·x + x(x+1)/2), Δ the pair saving."""
    saving = shape.pair_flops("absorbed") - shape.pair_flops("rebuilt")
    if saving <= 0:
        return math.inf
    if prefix_len <= 0:
        return 0.0
    return positive_root(saving / 2.0, saving * (prefix_len + 0.5), -shape.kv_b_flops * prefix_len)


def asymptotic_crossover(shape: MlaShape) -> float:
    """The crossover for L ≫ x: W / Δ = r·(dn + dv) / (2r − dn − dv), independent of the head count."""
    saving = shape.pair_flops("absorbed") - shape.pair_flops("rebuilt")
    return math.inf if saving <= 0 else shape.kv_b_flops / saving


def latency_terms(shape: MlaShape, num_layers: int, flops_per_s: float, form: str = "rebuilt") -> tuple[float, float]:
    """(γ, a) of t(L, x) for `num_layers` layers at `flops_per_s`: γ = W per cached token (0 absorbed),
    a = pair FLOPs / 2, since the model's area 2·L·x + x² counts each causal pair twice."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    gamma = shape.kv_b_flops * num_layers / flops_per_s if form == "rebuilt" else 0.0
    return gamma, shape.pair_flops(form) / 2.0 * num_layers / flops_per_s
