"""Model configuration: one frozen dataclass for every family, read from a Hugging Face `config.json`.

`ModelConfig.from_pretrained(folder)` reads the file, `from_hf_dict` validates and normalises it: the
fields every decoder shares are read here, the ones that differ (biases, sliding windows, q/k norms,
experts and which layers have them) by the architecture's family (`jaxcpp.models.families`).
`to_hf_dict` writes a `config.json` that `transformers` loads back. Both the old (`rope_theta` +
`rope_scaling`) and the transformers-5 (`rope_parameters`) spellings of RoPE are accepted. `LlamaConfig`
is the same class under its first name. Host-side: no jax here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.families import FAMILIES, Family
from jaxcpp.models.families.base import check as _check
from jaxcpp.models.families.base import is_int as _is_int
from jaxcpp.models.families.base import typed as _typed

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
ARCHITECTURES = {arch: family.model_type for arch, family in FAMILIES.items()}
MODEL_TYPES = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (and o_proj's for Llama); Qwen2: always, Mistral: never
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    dtype: str = "float32"  # the checkpoint's parameter dtype
    sliding_window: int | None = None  # kept for round trips; max_position_embeddings is capped to it
    qk_norm: bool = False  # RMSNorm on q and k over head_dim before RoPE (Qwen3)
    num_experts: int = 0  # > 0: a mixture of experts in every layer not in dense_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # an MoE model's layers that keep the dense MLP
    # DeepSeek's MoE block (families/deepseek.py): the router's scoring and grouping, shared experts
    router: str = "softmax"  # "softmax" (every other family, DeepSeek-V2) or "sigmoid" (DeepSeek-V3)
    topk_method: str = "greedy"  # "greedy" or "group_limited" (V2: by group max; V3: by group top-2 sum)
    n_group: int = 1  # expert groups; "group_limited" keeps the best topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    n_shared_experts: int = 0  # > 0: a SwiGLU of n_shared_experts * moe_intermediate_size beside the experts
    # Qwen2-MoE's shared expert (families/qwen2_moe.py): a SwiGLU of this width beside the routed experts,
    # its output scaled by sigmoid(x · shared_expert_gate) per token
    shared_expert_intermediate_size: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; models/mla.py): kv_lora_rank > 0 selects it.
    # head_dim is then qk_rope_head_dim (what RoPE rotates) and the KV pages hold latent rows.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a plain q_proj (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3), ... instead of the rotate-half halves

    def __post_init__(self) -> None:
        _check(self.architecture in ARCHITECTURES, "architectures",
               f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, f"must be a positive integer, got {value!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
               f"({self.num_key_value_heads}) must divide num_attention_heads ({self.num_attention_heads})")
        _check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _check(self.rope_theta > 0, "rope_theta", "must be > 0")
        _check(self.dtype in DTYPES, "torch_dtype", f"unsupported dtype {self.dtype!r}; supported: {DTYPES}")
        _validate_rope_scaling(self.rope_scaling, allow_yarn=self.is_mla)
        fixed = self.family.fixed_bias
        _check(fixed is None or self.attention_bias == fixed, "attention_bias",
               f"{self.architecture} {'always' if fixed else 'never'} has q/k/v biases")
        if self.num_experts:
            _check(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                   f"must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
            _check(self.moe_intermediate_size >= 1, "moe_intermediate_size", "must be a positive integer")
            _check(self.num_experts % self.n_group == 0 and 1 <= self.topk_group <= self.n_group, "n_group",
                   f"({self.n_group}) must divide n_routed_experts ({self.num_experts}) and topk_group "
                   f"({self.topk_group}) be in [1, n_group]")
        if self.is_mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(self, name)
                _check(_is_int(value) and value >= 1, name, f"must be a positive integer, got {value!r}")
            _check(self.head_dim == self.qk_rope_head_dim, "head_dim", "must equal qk_rope_head_dim for MLA")

    @property
    def shared_expert_width(self) -> int:
        """The SwiGLU width of the shared expert(s) every token runs beside the routed ones (0: none):
        DeepSeek's n_shared_experts × moe_intermediate_size, Qwen2-MoE's shared_expert_intermediate_size."""
        return self.moe_intermediate_size * self.n_shared_experts or self.shared_expert_intermediate_size

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): a latent KV cache, models/mla.py's attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def __hash__(self) -> int:  # the config is a static jit argument; rope_scaling is a dict
        items = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(tuple(items if f.name == "rope_scaling" else getattr(self, f.name)
                          for f in dataclasses.fields(self)))

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def attention_out_bias(self) -> bool:
        """o_proj bias: Llama's (and Qwen3's) `attention_bias` covers all four projections, Qwen2's only q/k/v."""
        return self.attention_bias and self.family.bias_covers_o_proj

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_runs(self, start: int = 0, end: int | None = None) -> list[tuple[bool, int, int]]:
        """Layers [start, end) as runs of alike layers: (is_moe, run start, run end). Each run is one
        stacked tree and one `lax.scan`; a dense model, or an MoE model without dense layers, is one run."""
        end = self.num_hidden_layers if end is None else end
        runs: list[tuple[bool, int, int]] = []
        for layer in range(start, end):
            moe = self.is_moe_layer(layer)
            if runs and runs[-1][0] == moe:
                runs[-1] = (moe, runs[-1][1], layer + 1)
            else:
                runs.append((moe, layer, layer + 1))
        return runs

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters: an MoE layer holds every expert but runs only
        `num_experts_per_tok` of them."""
        d, heads, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attention = d * hd * (2 * heads + 2 * kv) + 2 * d + (2 * hd if self.qk_norm else 0)
        if self.attention_bias:
            attention += hd * (heads + 2 * kv) + (d if self.attention_out_bias else 0)
        if self.is_mla:
            attention = self._mla_param_count()
        dense = 3 * d * self.intermediate_size
        expert = 3 * d * self.moe_intermediate_size
        shared = (3 * d * self.shared_expert_width + (d if self.shared_expert_intermediate_size else 0)  # Qwen2's gate
                  + (self.num_experts if self.router == "sigmoid" else 0))  # V3's selection bias
        total = active = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for layer in range(self.num_hidden_layers):
            if self.is_moe_layer(layer):
                router = d * self.num_experts
                total += attention + router + shared + self.num_experts * expert
                active += attention + router + shared + self.num_experts_per_tok * expert
            else:
                total += attention + dense
                active += attention + dense
        return total, active

    def _mla_param_count(self) -> int:
        """One MLA layer's attention parameters (q LoRA or q_proj, kv LoRA, kv_b, o_proj, norms, biases)."""
        d, heads, rank, q_rank = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.q_lora_rank
        q = d * q_rank + q_rank + q_rank * heads * self.qk_head_dim if q_rank else d * heads * self.qk_head_dim
        kv = d * (rank + self.qk_rope_head_dim) + rank + rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        bias = (q_rank + rank + self.qk_rope_head_dim + d) if self.attention_bias else 0
        return q + kv + heads * self.v_head_dim * d + bias + 2 * d

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf_dict(d: dict[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
        """Validate a Hugging Face config dict; errors name `source` and the offending field."""
        try:
            return _from_hf_dict(d)
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from None

    @staticmethod
    def from_pretrained(folder: str | Path) -> ModelConfig:
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found (a model folder needs a Hugging Face {CONFIG_FILE})")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable JSON ({e})") from None
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return ModelConfig.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that both transformers 4 (rope_theta/rope_scaling) and 5 read."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_out(self.eos_token_ids),
            "torch_dtype": self.dtype,
        }
        return {**d, **self.family.to_hf(self)}


LlamaConfig = ModelConfig  # the name it had while Llama was the only family


def _validate_rope_scaling(rope: dict[str, Any] | None, allow_yarn: bool = False) -> None:
    if rope is None:
        return
    kind = rope.get("rope_type", rope.get("type"))
    kinds = ("linear", "llama3", "yarn") if allow_yarn else ("linear", "llama3")  # yarn: MLA families only
    _check(kind in kinds, "rope_scaling.rope_type",
           f"unsupported RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES + kinds[2:])}")
    if kind == "yarn":  # factor may be absent (then max_position_embeddings / the original), as transformers
        _check(isinstance(rope.get("original_max_position_embeddings"), int),
               "rope_scaling.original_max_position_embeddings", "missing or not an integer for rope_type 'yarn'")
        return
    needed = ("factor",) if kind == "linear" else _LLAMA3_KEYS
    for key in needed:
        _check(isinstance(rope.get(key), (int, float)), f"rope_scaling.{key}",
               f"missing or not a number for rope_type {kind!r}")


def _eos_out(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        _check(isinstance(archs, list) and len(archs) == 1, "architectures",
               f"expected a list with one entry, got {archs!r}")
        return str(archs[0])
    model_type = d.get("model_type")
    _check(model_type is not None, "architectures", "missing (and no model_type to infer it from)")
    _check(model_type in MODEL_TYPES, "model_type",
           f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return MODEL_TYPES[str(model_type)]


def _required(d: dict[str, Any], key: str) -> Any:
    _check(d.get(key) is not None, key, "missing")
    return d[key]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling; 'default' scaling becomes None."""
    params = _typed(d, "rope_parameters", "object")
    if params:
        _check("rope_theta" in params or "rope_theta" in d, "rope_parameters.rope_theta", "missing")
        theta = float(_typed(params, "rope_theta", "number", _typed(d, "rope_theta", "number", 10000.0)))
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(_typed(d, "rope_theta", "number", 10000.0))
        rope_scaling = _typed(d, "rope_scaling", "object")
        scaling = dict(rope_scaling) if rope_scaling else None
    if scaling is not None:
        kind = scaling.pop("type", None)  # the pre-4.45 spelling
        scaling.setdefault("rope_type", kind)
        if scaling["rope_type"] == "default" or scaling == {"rope_type": None}:
            scaling = None
    return theta, scaling


def _from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    arch = _architecture(d)
    _check(arch in ARCHITECTURES, "architectures",
           f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    family_fields = FAMILIES[arch].parse(d)
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    _check(act == "silu", "hidden_act", f"only 'silu' (SwiGLU) is supported, got {act!r}")
    _check(not d.get("mlp_bias", False), "mlp_bias", "MLP biases are not supported")
    pr = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    _check(pr == 1.0, "partial_rotary_factor", f"only full rotary embeddings are supported, got {pr!r}")

    hidden = _typed(d, "hidden_size", "int", _required(d, "hidden_size"))
    heads = _typed(d, "num_attention_heads", "int", _required(d, "num_attention_heads"))
    kv_heads = _typed(d, "num_key_value_heads", "int") or heads
    head_dim = _typed(d, "head_dim", "int") or (hidden // heads if heads else 0)
    theta, scaling = _rope(d)
    eos = d.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    _check(all(_is_int(e) for e in eos_list), "eos_token_id", f"must be an integer or a list of them, got {eos!r}")
    eos_ids = tuple(eos_list)
    dtype_key = "torch_dtype" if d.get("torch_dtype") is not None else "dtype"
    dtype = _typed(d, dtype_key, "string", "float32")
    max_pos = _typed(d, "max_position_embeddings", "int", _required(d, "max_position_embeddings"))
    window = family_fields["sliding_window"]
    if window is not None and window < max_pos:
        # Within the window, sliding-window attention equals full attention; beyond it we would be
        # wrong, so the usable context is capped instead (see docs/models.md).
        logger.warning("sliding_window=%d < max_position_embeddings=%d: capping the context at %d tokens",
                       window, max_pos, window)
        max_pos = window
    fields: dict[str, Any] = dict(
        vocab_size=_typed(d, "vocab_size", "int", _required(d, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=_typed(d, "intermediate_size", "int", _required(d, "intermediate_size")),
        num_hidden_layers=_typed(d, "num_hidden_layers", "int", _required(d, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_typed(d, "rms_norm_eps", "number", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=_typed(d, "tie_word_embeddings", "bool", False),
        bos_token_id=_typed(d, "bos_token_id", "int"),
        eos_token_ids=eos_ids,
        architecture=arch,
        dtype=str(dtype),
    )
    return ModelConfig(**{**fields, **family_fields})  # a family may override a shared field (MLA: head_dim)
