"""Qwen2-MoE: Qwen2's attention (q/k/v biases, none on o_proj), Qwen3-MoE's router and rule for which
layers are sparse, and a shared expert every token runs beside the routed ones, its output scaled by
sigmoid(x · shared_expert_gate) (transformers' Qwen2MoeSparseMoeBlock)."""

from __future__ import annotations

from typing import Any

from jaxcpp.models.families.base import Family, ModelConfig, check, sliding_window, typed
from jaxcpp.models.families.qwen3 import sparse_layer_fields


def _qwen2_moe(d: dict[str, Any]) -> dict[str, Any]:
    shared = typed(d, "shared_expert_intermediate_size", "int")
    check(shared is not None and shared >= 1, "shared_expert_intermediate_size",
          f"must be a positive integer, got {shared!r}")
    return {"attention_bias": True, "sliding_window": sliding_window(d, gated=True),
            **sparse_layer_fields(d), "shared_expert_intermediate_size": shared}


def _qwen2_moe_hf(config: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window, "use_sliding_window": False,
            "num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "decoder_sparse_step": 1, "mlp_only_layers": list(config.dense_layers)}


QWEN2_MOE = Family("Qwen2MoeForCausalLM", "qwen2_moe", _qwen2_moe, _qwen2_moe_hf, fixed_bias=True)
