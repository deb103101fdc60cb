"""What makes a model family: its config fields, its checkpoint names, its dense and sparse layers.

A family is a small description, not a model: the decoder (`jaxcpp.models.llama`) is shared and built
from pieces (attention with or without q/k norms, the dense MLP or the MoE block), and a family says
which pieces its config asks for and what transformers calls each tensor. Host side: no jax here.

    Family(architecture, model_type, parse, to_hf, hf_module)
    parse(config.json dict) -> the ModelConfig fields that differ between families
    to_hf(config) -> those fields spelled for config.json
    hf_module(our module path, expert) -> transformers' module path of one layer's tensor
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxcpp.errors import ModelLoadError

# A jaxcpp.models.config.ModelConfig: named, not imported, since the config module imports the families.
ModelConfig = Any


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ModelLoadError(f"{field}: {message}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a layer count


def typed(d: dict[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """d[key] (or `default` when absent or null), checked to be JSON `kind`: int, number, bool,
    string, object or list; a wrong type is a ModelLoadError naming the field, not a TypeError later."""
    value = d.get(key)
    if value is None:
        return default
    ok = {"int": is_int(value), "number": is_int(value) or isinstance(value, float),
          "bool": isinstance(value, bool), "string": isinstance(value, str),
          "object": isinstance(value, dict), "list": isinstance(value, list)}[kind]
    check(ok, key, f"must be a JSON {kind}, got {value!r}")
    return value


def hf_module_path(modules: tuple[str, ...], expert: int | None) -> str:
    """transformers' spelling of most families: our module names, the expert's index after `experts`."""
    if expert is None:
        return ".".join(modules)
    i = modules.index("experts") + 1
    return ".".join((*modules[:i], str(expert), *modules[i:]))


def sliding_window(d: dict[str, Any], gated: bool) -> int | None:
    """config.json's `sliding_window`; `gated` families (Qwen) use it only with `use_sliding_window`."""
    if gated and not d.get("use_sliding_window", False):
        return None
    window = d.get("sliding_window")
    check(window is None or (is_int(window) and window >= 1), "sliding_window",
          f"must be a positive integer or null, got {window!r}")
    return window


def moe_fields(d: dict[str, Any], experts_key: str, intermediate_key: str, norm_topk_prob: bool | None
               ) -> dict[str, Any]:
    """The MoE block's fields: experts, experts per token, each expert's width, and whether the chosen
    experts' weights are renormalised to sum to 1 (`norm_topk_prob`; None: read it from the config)."""
    experts = typed(d, experts_key, "int", typed(d, "num_local_experts", "int"))
    check(experts is not None and experts >= 1, experts_key, f"must be a positive integer, got {experts!r}")
    top_k = typed(d, "num_experts_per_tok", "int")
    check(top_k is not None and 1 <= top_k <= experts, "num_experts_per_tok",
          f"must be an integer in [1, {experts}], got {top_k!r}")
    width = typed(d, intermediate_key, "int")
    check(width is not None and width >= 1, intermediate_key, f"must be a positive integer, got {width!r}")
    norm = typed(d, "norm_topk_prob", "bool", False) if norm_topk_prob is None else norm_topk_prob
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": norm}


@dataclass(frozen=True)
class Family:
    architecture: str                                              # config.json's architectures[0]
    model_type: str                                                # its model_type
    parse: Callable[[dict[str, Any]], dict[str, Any]]              # family-specific ModelConfig fields
    to_hf: Callable[[ModelConfig], dict[str, Any]]                 # ... and back, for config.json
    hf_module: Callable[[tuple[str, ...], int | None], str] = hf_module_path
    bias_covers_o_proj: bool = False                               # attention_bias on o_proj too (Llama)
    fixed_bias: bool | None = None                                 # biases the family always/never has
