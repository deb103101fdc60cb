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
from typing import Any

from jaxcpp.chunking.planner import positive_root

FORMS = ("absorbed", "rebuilt")
# --mla-prefill: how prefill chunks attend. auto: the FLOP rule weighted by this device's measured
# speed of each form (`fit_rebuild_weight`, timed at start-up); flops: the FLOP rule as it stands.
PREFILL_MODES = ("auto", "flops", "absorbed", "rebuilt")
FIXED_WEIGHTS = {"flops": 1.0, "absorbed": math.inf, "rebuilt": 0.0}


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
    def of(config: Any) -> MlaShape:
        """An MLA model config's (`jaxcpp.models.config.ModelConfig`) head layout."""
        return MlaShape(config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim,
                        config.qk_rope_head_dim, config.v_head_dim)

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


def prefer_rebuild(shape: MlaShape, prefix_len: float, chunk: float, rebuild_weight: float = 1.0) -> bool:
    """The per-chunk choice: rebuild the prefix when `rebuild_weight` x its FLOPs is below the absorbed
    form's FLOPs. Weight 1 is the FLOP rule; the device's measured weight (`fit_rebuild_weight`) makes
    it that device's crossover; inf never rebuilds (`--mla-prefill absorbed`), 0 always (`rebuilt`)."""
    rebuilt = attention_flops(shape, prefix_len, chunk, "rebuilt")
    return rebuild_weight * rebuilt < attention_flops(shape, prefix_len, chunk, "absorbed") if rebuilt else False


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


def fixed_rebuild_weight(mode: str) -> float | None:
    """The rebuild weight `--mla-prefill mode` fixes, or None for auto (measured at start-up)."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"--mla-prefill must be one of {PREFILL_MODES}, got {mode!r}")
    return FIXED_WEIGHTS.get(mode)


@dataclass(frozen=True)
class FormTiming:
    """Both forms of one MLA layer's attention timed on the device for a chunk after a prefix."""

    prefix_len: int
    chunk: int
    absorbed_s: float
    rebuilt_s: float


def fit_rebuild_weight(shape: MlaShape, timings: list[FormTiming]) -> float:
    """The weight w for which "rebuild iff w x rebuilt FLOPs < absorbed FLOPs" agrees with the most
    timed points (where rebuilding was measured faster), the one nearest 1 (the FLOP rule) among ties:
    a point rebuilds under w iff w < its FLOP ratio absorbed / rebuilt, so candidates sit between the
    sorted ratios (geometric midpoints), below the smallest and above the largest (x2 / x0.5)."""
    if not timings:
        raise ValueError("fit_rebuild_weight needs at least one timing")
    ratios = [attention_flops(shape, t.prefix_len, t.chunk, "absorbed")
              / attention_flops(shape, t.prefix_len, t.chunk, "rebuilt") for t in timings]
    ordered = sorted(ratios)
    candidates = [ordered[0] / 2, ordered[-1] * 2, 1.0]
    candidates += [math.sqrt(lo * hi) for lo, hi in zip(ordered, ordered[1:], strict=False) if lo < hi]

    def misses(weight: float) -> int:
        return sum((weight < ratio) != (t.rebuilt_s < t.absorbed_s) for ratio, t in zip(ratios, timings, strict=True))

    return min(candidates, key=lambda w: (misses(w), abs(math.log(w))))


def planned_form(shape: MlaShape, rebuild_weight: float, chunks: tuple[int, int]) -> str:
    """How the chunks dynamic chunking plans (`chunks`: its smallest and largest, after a prefix of the
    largest) attend under the rule: "absorbed", "rebuilt", or "mixed" when the rule switches between them."""
    smallest, largest = chunks
    forms = {prefer_rebuild(shape, largest, x, rebuild_weight) for x in (smallest, largest)}
    return "mixed" if len(forms) == 2 else ("rebuilt" if forms.pop() else "absorbed")
