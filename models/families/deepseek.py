"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (and Kimi-K2, which ships V3's config): multi-head latent
attention (models/mla.py), `first_k_dense_replace` dense layers, then MoE layers with shared experts.

    V2: softmax router, `topk_method` greedy or group_limited_greedy (groups ranked by their best
        expert), weights times `routed_scaling_factor`; RoPE always on interleaved pairs.
    V3: sigmoid router, `e_score_correction_bias` added for the choice only, groups ranked by the sum of
        their best two, `norm_topk_prob`, then `routed_scaling_factor`; `rope_interleave` as configured.

Where transformers (5.x, modeling_deepseek_v2.py) and DeepSeek's original code differ we follow
transformers: its V2 router never renormalises (the original does when `norm_topk_prob`; every released
V2 config has it false) and every layer from `first_k_dense_replace` on is MoE (the original also reads
`moe_layer_freq`, 1 in every released config; another value is refused). The multi-token-prediction
layer the V3 checkpoints carry (`num_nextn_predict_layers`, tensors `model.layers.{num_hidden_layers}.*`)
is not read: it is skipped with a log line.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxcpp.models.families.base import Family, ModelConfig, check, is_int, moe_fields, typed

logger = logging.getLogger(__name__)


def _mla(d: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = typed(d, key, "int")
        check(value is not None and value >= 1, key, f"must be a positive integer, got {value!r}")
        fields[key] = value
    q_rank = typed(d, "q_lora_rank", "int", 0)
    check(q_rank >= 0, "q_lora_rank", f"must be a positive integer or null, got {q_rank!r}")
    heads = typed(d, "num_attention_heads", "int", 1)
    # RoPE rotates the qk_rope_head_dim part only; the KV "heads" are the latent's (one row a token)
    return {**fields, "q_lora_rank": q_rank, "head_dim": fields["qk_rope_head_dim"], "num_key_value_heads": heads}


def _moe(d: dict[str, Any], v3: bool) -> dict[str, Any]:
    layers = typed(d, "num_hidden_layers", "int", 0)
    first_dense = typed(d, "first_k_dense_replace", "int", 0)
    check(0 <= first_dense <= layers, "first_k_dense_replace", f"must be in [0, {layers}], got {first_dense!r}")
    freq = typed(d, "moe_layer_freq", "int", 1)
    check(freq == 1, "moe_layer_freq", f"only 1 (every layer after the dense ones) is supported, got {freq!r}")
    experts = moe_fields(d, "n_routed_experts", "moe_intermediate_size", None if v3 else False)
    n_group, topk_group = typed(d, "n_group", "int") or 1, typed(d, "topk_group", "int") or 1
    method = typed(d, "topk_method", "string", "noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    check(method in allowed, "topk_method", f"must be one of {allowed} for this architecture, got {method!r}")
    grouped = v3 or method == "group_limited_greedy"
    shared = typed(d, "n_shared_experts", "int", 0)
    check(shared >= 0, "n_shared_experts", f"must be >= 0, got {shared!r}")
    scaling = typed(d, "routed_scaling_factor", "number", 1.0)
    return {**experts, "dense_layers": tuple(range(first_dense)), "router": "sigmoid" if v3 else "softmax",
            "topk_method": "group_limited" if grouped else "greedy", "n_group": n_group if grouped else 1,
            "topk_group": topk_group if grouped else 1, "routed_scaling_factor": float(scaling),
            "n_shared_experts": shared}


def _skip_mtp(d: dict[str, Any]) -> None:
    mtp = typed(d, "num_nextn_predict_layers", "int", 0)
    if mtp:
        logger.info("%s: %d multi-token-prediction layer(s) (model.layers.%s.*) skipped: not used for decoding",
                    d.get("architectures", ["DeepSeek"])[0], mtp, typed(d, "num_hidden_layers", "int", "N"))


def _common(d: dict[str, Any], v3: bool) -> dict[str, Any]:
    experts = d.get("n_routed_experts")
    check(is_int(experts), "n_routed_experts", f"must be an integer, got {experts!r}")
    _skip_mtp(d)
    return {"attention_bias": typed(d, "attention_bias", "bool", False), "sliding_window": None,
            **_mla(d), **_moe(d, v3)}


def _v2(d: dict[str, Any]) -> dict[str, Any]:
    return {**_common(d, v3=False), "rope_interleave": True}  # transformers' V2 RoPE: complex pairs, always


def _v3(d: dict[str, Any]) -> dict[str, Any]:
    return {**_common(d, v3=True), "rope_interleave": typed(d, "rope_interleave", "bool", True)}


def _hf(config: ModelConfig) -> dict[str, Any]:
    v3 = config.router == "sigmoid"
    out = {"attention_bias": config.attention_bias, "kv_lora_rank": config.kv_lora_rank,
           "q_lora_rank": config.q_lora_rank or None, "qk_nope_head_dim": config.qk_nope_head_dim,
           "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
           "n_routed_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
           "moe_intermediate_size": config.moe_intermediate_size, "n_shared_experts": config.n_shared_experts,
           "first_k_dense_replace": len(config.dense_layers), "routed_scaling_factor": config.routed_scaling_factor,
           "n_group": config.n_group, "topk_group": config.topk_group, "norm_topk_prob": config.norm_topk_prob}
    if v3:
        return {**out, "rope_interleave": config.rope_interleave, "topk_method": "noaux_tc",
                "num_nextn_predict_layers": 0}
    grouped = config.topk_method == "group_limited"
    return {**out, "topk_method": "group_limited_greedy" if grouped else "greedy"}


DEEPSEEK_V2 = Family("DeepseekV2ForCausalLM", "deepseek_v2", _v2, _hf)
DEEPSEEK_V3 = Family("DeepseekV3ForCausalLM", "deepseek_v3", _v3, _hf)
