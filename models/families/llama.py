"""Llama, Mistral and Qwen2: dense decoders that differ in their biases and sliding windows."""

from __future__ import annotations

from typing import Any

from jaxcpp.models.families.base import Family, ModelConfig, sliding_window, typed


def _llama(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": typed(d, "attention_bias", "bool", False), "sliding_window": None}


def _llama_hf(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "mlp_bias": False}


def _mistral(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "sliding_window": sliding_window(d, gated=False)}  # HF's Mistral: no biases


def _qwen2(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, "sliding_window": sliding_window(d, gated=True)}


LLAMA = Family("LlamaForCausalLM", "llama", _llama, _llama_hf, bias_covers_o_proj=True)
MISTRAL = Family("MistralForCausalLM", "mistral", _mistral, lambda c: {"sliding_window": c.sliding_window},
                 fixed_bias=False)
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", _qwen2,
               lambda c: {"sliding_window": c.sliding_window, "use_sliding_window": False}, fixed_bias=True)
