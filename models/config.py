"""Model configuration: one frozen dataclass for the Llama family, read from a Hugging Face `config.json`.

`LlamaConfig.from_pretrained(folder)` reads the file, `from_hf_dict` validates and normalises it (the
three supported architectures differ only in defaults: Qwen2 always has q/k/v bias), and `to_hf_dict`
writes a `config.json` that `transformers` loads back. Both the old (`rope_theta` + `rope_scaling`) and
the transformers-5 (`rope_parameters`) spellings of RoPE are accepted. Host-side: no jax here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxcpp.errors import ModelLoadError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig:
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
        _validate_rope_scaling(self.rope_scaling)
        if self.model_type != "llama":
            want = self.model_type == "qwen2"
            _check(self.attention_bias == want, "attention_bias",
                   f"{self.architecture} {'always' if want else 'never'} has q/k/v biases")

    def __hash__(self) -> int:  # the config is a static jit argument; rope_scaling is a dict
        items = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(tuple(items if f.name == "rope_scaling" else getattr(self, f.name)
                          for f in dataclasses.fields(self)))

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def attention_out_bias(self) -> bool:
        """o_proj bias: Llama's `attention_bias` covers all four projections, Qwen2's only q/k/v."""
        return self.attention_bias and self.model_type == "llama"

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf_dict(d: dict[str, Any], source: str = CONFIG_FILE) -> LlamaConfig:
        """Validate a Hugging Face config dict; errors name `source` and the offending field."""
        try:
            return _from_hf_dict(d)
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from None

    @staticmethod
    def from_pretrained(folder: str | Path) -> LlamaConfig:
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found (a model folder needs a Hugging Face {CONFIG_FILE})")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable JSON ({e})") from None
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return LlamaConfig.from_hf_dict(d, source=str(path))

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
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        else:
            d["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2":
            d["use_sliding_window"] = False
        return d


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ModelLoadError(f"{field}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a layer count


def _typed(d: dict[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """d[key] (or `default` when absent or null), checked to be JSON `kind`: int, number, bool,
    string or object; a wrong type is a ModelLoadError naming the field, not a TypeError later."""
    value = d.get(key)
    if value is None:
        return default
    ok = {"int": _is_int(value), "number": _is_int(value) or isinstance(value, float),
          "bool": isinstance(value, bool), "string": isinstance(value, str),
          "object": isinstance(value, dict)}[kind]
    _check(ok, key, f"must be a JSON {kind}, got {value!r}")
    return value


def _validate_rope_scaling(rope: dict[str, Any] | None) -> None:
    if rope is None:
        return
    kind = rope.get("rope_type", rope.get("type"))
    _check(kind in ("linear", "llama3"), "rope_scaling.rope_type",
           f"unsupported RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
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


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    if model_type == "llama":
        return None
    if model_type == "qwen2" and not d.get("use_sliding_window", False):
        return None
    window = d.get("sliding_window")
    _check(window is None or (isinstance(window, int) and window >= 1), "sliding_window",
           f"must be a positive integer or null, got {window!r}")
    return window


def _from_hf_dict(d: dict[str, Any]) -> LlamaConfig:
    arch = _architecture(d)
    _check(arch in ARCHITECTURES, "architectures",
           f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    model_type = ARCHITECTURES[arch]
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
    window = _sliding_window(d, model_type)
    if window is not None and window < max_pos:
        # Within the window, sliding-window attention equals full attention; beyond it we would be
        # wrong, so the usable context is capped instead (see docs/models.md).
        logger.warning("sliding_window=%d < max_position_embeddings=%d: capping the context at %d tokens",
                       window, max_pos, window)
        max_pos = window
    # HF's Mistral has no biases whatever the field says; Qwen2 always has q/k/v biases.
    bias = {"llama": _typed(d, "attention_bias", "bool", False), "mistral": False, "qwen2": True}[model_type]
    return LlamaConfig(
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
        attention_bias=bias,
        bos_token_id=_typed(d, "bos_token_id", "int"),
        eos_token_ids=eos_ids,
        architecture=arch,
        dtype=str(dtype),
        sliding_window=window,
    )
