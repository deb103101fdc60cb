"""Mixtral: Mistral's attention, every layer a mixture of experts whose chosen weights are renormalised.

transformers keeps Mixtral's original tensor names: the block is `block_sparse_moe`, its experts'
projections `w1` (gate), `w3` (up) and `w2` (down).
"""

from __future__ import annotations

from typing import Any

from jaxcpp.models.families.base import Family, ModelConfig, hf_module_path, moe_fields, sliding_window

_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _mixtral(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "sliding_window": sliding_window(d, gated=False),
            **moe_fields(d, "num_local_experts", "intermediate_size", norm_topk_prob=True)}


def _mixtral_hf(config: ModelConfig) -> dict[str, Any]:
    # Mixtral has no dense layer: its experts' width is config.json's intermediate_size
    return {"sliding_window": config.sliding_window, "intermediate_size": config.moe_intermediate_size,
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok}


def _mixtral_module(modules: tuple[str, ...], expert: int | None) -> str:
    if modules[0] == "mlp":
        modules = ("block_sparse_moe", *(_EXPERT_NAMES.get(m, m) if expert is not None else m for m in modules[1:]))
    return hf_module_path(modules, expert)


MIXTRAL = Family("MixtralForCausalLM", "mixtral", _mixtral, _mixtral_hf, _mixtral_module, fixed_bias=False)
