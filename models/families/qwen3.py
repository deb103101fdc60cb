"""Qwen3 and Qwen3-MoE: RMSNorm on q and k over the head dim before RoPE, an explicit head_dim.

Qwen3-MoE's sparse layers are those with `(i + 1) % decoder_sparse_step == 0` not listed in
`mlp_only_layers` (transformers' rule, Qwen2-MoE's too); the others keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from typing import Any

from jaxcpp.models.families.base import Family, ModelConfig, check, is_int, moe_fields, sliding_window, typed


def _qwen3(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": typed(d, "attention_bias", "bool", False), "qk_norm": True,
            "sliding_window": sliding_window(d, gated=True)}


def _qwen3_hf(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "sliding_window": config.sliding_window,
            "use_sliding_window": False}


def sparse_layer_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of Qwen's MoE families (Qwen2-MoE, Qwen3-MoE), sparse layers by transformers' rule."""
    layers = typed(d, "num_hidden_layers", "int", 0)
    step = typed(d, "decoder_sparse_step", "int", 1)
    check(step >= 1, "decoder_sparse_step", f"must be a positive integer, got {step!r}")
    mlp_only = typed(d, "mlp_only_layers", "list", [])
    check(all(is_int(i) and 0 <= i < layers for i in mlp_only), "mlp_only_layers",
          f"must list layer indices in [0, {layers}), got {mlp_only!r}")
    dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step != 0)
    return {**moe_fields(d, "num_experts", "moe_intermediate_size", None), "dense_layers": dense}


def _qwen3_moe(d: dict[str, Any]) -> dict[str, Any]:
    return {**_qwen3(d), **sparse_layer_fields(d)}


def _qwen3_moe_hf(config: ModelConfig) -> dict[str, Any]:
    return {**_qwen3_hf(config), "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(config.dense_layers)}


QWEN3 = Family("Qwen3ForCausalLM", "qwen3", _qwen3, _qwen3_hf, bias_covers_o_proj=True)
QWEN3_MOE = Family("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe, _qwen3_moe_hf, bias_covers_o_proj=True)
