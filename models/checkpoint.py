"""Checkpoint I/O: Hugging Face folders (config.json + safetensors shards) and jaxcpp's orbax folders.

Loading builds the expected params tree from the config (`jax.eval_shape(init_params)`), then fills each
leaf from the HF tensor(s) it corresponds to: Linear weights are transposed (`[out, in]` -> `[in, out]`)
and per-layer tensors are stacked on a leading `[L]` axis. Tensors are read with a small memory-mapped
safetensors reader (`jaxcpp.models.safetensors_file`: `safetensors.numpy` cannot represent bfloat16). Orbax folders hold
`config.json` (HF format, so the same parser reads both) beside `params/`. `resolve_model` turns a
CLI model name into (config, params, tokenizer). Every failure is a `ModelLoadError` naming the file.

A pipeline stage loads only its own part (`load_stage_params`): its decoder layers, plus the embedding
and the head where it needs them. Safetensors are memory-mapped, so only those tensors are read; an
orbax folder's arrays are read through tensorstore (the storage orbax writes: OCDBT + zarr) one
layer range at a time. Peak host memory while loading a P-stage model is about 1/P of it per stage.

FP8 weights. A decoder-layer Linear stored in float8_e4m3 (safetensors F8_E4M3) loads as it is, with
its `weight_scale` beside it (per tensor: [] or [1]; per output channel: [out] or [out, 1], the layouts
of compressed-tensors "FP8" / "FP8-dynamic" and fbgemm_fp8 checkpoints), as `kernel` + `kernel_scale`
([out], a per-tensor scale repeated). `--quantization fp8` makes the same pair from a float checkpoint,
one scale per output channel. Embedding, norms and LM head stay in the model dtype. fp8 KV-cache scales
come from the layers' `self_attn.k_scale` / `v_scale` (vLLM's names) where the checkpoint has them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import CONFIG_FILE, LlamaConfig
from jaxcpp.models.fp8 import FP8_E4M3_MAX, FP8_WEIGHT_DTYPE, quantize_fp8_per_channel, read_hf_fp8_kernel
from jaxcpp.models.llama import DecoderLayer, Params, init_attend, init_params
from jaxcpp.models.runs import runs_of
from jaxcpp.models.safetensors_file import FP8_NP, SafetensorsFile, open_shards
from jaxcpp.models.spec import BUNDLED_MODELS, ORBAX_PARAMS_DIR, ModelSpec, resolve_model_spec
from jaxcpp.tokenizer import Tokenizer

__all__ = ["BUNDLED_MODELS", "FP8_E4M3_MAX", "ORBAX_PARAMS_DIR", "load_hf", "load_orbax", "load_stage_params",
           "quantize_fp8_per_channel", "resolve_model", "save_hf", "save_orbax"]

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# ------------------------------------------------------------------------------------- name mapping


def _hf_names(config: LlamaConfig, path: tuple[str, ...], layer: int | None, expert: int | None = None
              ) -> tuple[str, bool]:
    """(HF tensor name, transpose?) of one leaf of our tree; `layer` for the stacked decoder leaves,
    `expert` for an MoE layer's stacked expert leaves (the family spells the module path)."""
    if path == ("embed",):
        return "model.embed_tokens.weight", False
    if path == ("norm",):
        return "model.norm.weight", False
    if path == ("lm_head",):
        return "lm_head.weight", True
    assert path[0] == "layers" and layer is not None, path
    *modules, leaf = path[1:]
    hf_leaf = {"kernel": "weight", "scale": "weight"}.get(leaf, leaf)  # bias, e_score_correction_bias
    module = config.family.hf_module(tuple(modules), expert)
    return f"model.layers.{layer}.{module}.{hf_leaf}", leaf == "kernel"


def _experts_of(config: LlamaConfig, path: tuple[str, ...]) -> list[int | None]:
    """The experts a leaf stacks (an MoE layer's `experts.*` leaves: all of them), else [None]."""
    return list(range(config.num_experts)) if "experts" in path else [None]


def _leaf_paths(tree: Params) -> Iterator[tuple[tuple[str, ...], Any]]:
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield tuple(k.key for k in keypath), leaf


def _layer_runs_of(config: LlamaConfig, layers: tuple[int, int]) -> Iterator[tuple[range, Params]]:
    """Each run of alike layers in [start, end), with one layer's expected leaves (shapes, no [L] axis)."""
    for moe, start, end in config.layer_runs(*layers):
        layer = DecoderLayer(config, moe=moe)
        one = jax.eval_shape(lambda layer=layer: layer.init(
            jax.random.key(0), jnp.zeros((1, config.hidden_size)), jnp.zeros((1,), jnp.int32),
            init_attend)["params"])
        yield range(start, end), one


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _expected_params(config: LlamaConfig) -> Params:
    """The params tree `config` implies, as shapes and dtypes only (nothing is allocated)."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def _write_config(folder: Path, config: LlamaConfig) -> None:
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")


def _cast(params: Params, dtype: str | None) -> Params:
    if dtype in (None, "auto"):
        return params
    target = _JNP_DTYPES[dtype]
    return jax.tree_util.tree_map(lambda x: x.astype(target), params)


# --------------------------------------------------------------------------------------- HF folders


def load_hf(folder: str | Path, dtype: str | None = None) -> tuple[LlamaConfig, Params]:
    """A Hugging Face folder: config.json + model.safetensors (or shards with an index)."""
    folder = Path(folder)
    config = LlamaConfig.from_pretrained(folder)
    spec = ModelSpec(str(folder), folder, config, None, "hf")
    params = load_stage_params(spec, (0, config.num_hidden_layers), True, True)
    return config, _cast(jax.tree_util.tree_map(jnp.asarray, params), dtype)


def _read_hf_leaf(tensors: dict[str, SafetensorsFile], folder: Path, config: LlamaConfig, path: tuple[str, ...],
                  shape: tuple[int, ...], layers: range | None) -> np.ndarray:
    """One leaf of our tree from its HF tensor(s); a decoder leaf stacks `layers` on a leading axis, an
    expert leaf each layer's experts on the next: [L, E, ...]."""
    stacked = []
    for layer in [None] if layers is None else layers:
        experts = _experts_of(config, path)
        per_expert = []
        for expert in experts:
            name, transpose = _hf_names(config, path, layer, expert)
            if name not in tensors:
                raise ModelLoadError(f"{folder}: tensor {name!r} missing from the safetensors files")
            array = tensors[name].get(name)
            array = array.T if transpose else array
            want = shape[(layer is not None) + (expert is not None):]
            if tuple(array.shape) != tuple(want):
                raise ModelLoadError(f"{tensors[name].path}: tensor {name!r} has shape {list(array.shape)}, "
                                     f"config.json implies {list(want)}")
            per_expert.append(array)
        stacked.append(per_expert[0] if experts == [None] else np.stack(per_expert))
    return stacked[0] if layers is None else np.stack(stacked)

def save_hf(folder: str | Path, params: Params, config: LlamaConfig) -> None:
    """Write config.json + model.safetensors that `transformers` loads (`from_pretrained(folder)`)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, leaf in _leaf_paths({k: v for k, v in params.items() if k != "layers"}):
        name, transpose = _hf_names(config, path, None)
        tensors[name] = np.ascontiguousarray(np.asarray(leaf).T if transpose else np.asarray(leaf))
    for run, (rows, _) in zip(runs_of(params["layers"]), _layer_runs_of(config, (0, config.num_hidden_layers)),
                              strict=True):
        for path, leaf in _leaf_paths(run):
            array = np.asarray(leaf)
            for row, layer in enumerate(rows):
                for expert in _experts_of(config, path):
                    value = array[row] if expert is None else array[row, expert]
                    name, transpose = _hf_names(config, ("layers", *path), layer, expert)
                    tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_config(folder, config)


# ------------------------------------------------------------------------------------ orbax folders


def save_orbax(folder: str | Path, params: Params, config: LlamaConfig) -> None:
    """`folder/params` (orbax) + `folder/config.json`; an existing params dir is replaced."""
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / ORBAX_PARAMS_DIR, params, force=True)
        ckptr.wait_until_finished()
    _write_config(folder, config)


def load_orbax(folder: str | Path, dtype: str | None = None) -> tuple[LlamaConfig, Params]:
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    config = LlamaConfig.from_pretrained(folder)
    params_dir = folder / ORBAX_PARAMS_DIR
    if not params_dir.is_dir():
        raise ModelLoadError(f"{params_dir}: orbax params directory not found")
    saved_dtype = _JNP_DTYPES[config.dtype]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, saved_dtype, sharding=sharding),
        _expected_params(config))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(params_dir, target)
    except Exception as e:  # orbax raises assorted types for missing or mismatched trees
        raise ModelLoadError(f"{params_dir}: cannot restore params for {CONFIG_FILE} ({e})") from None
    return config, _cast(params, dtype)


# ------------------------------------------------------------------------------------------ resolve


def resolve_model(name_or_path: str | Path, dtype: str | None = None
                  ) -> tuple[LlamaConfig, Params, Tokenizer | None]:
    """The whole model: 'tiny' (bundled), an orbax folder from `save_orbax`, or a Hugging Face folder."""
    spec = resolve_model_spec(name_or_path, dtype)
    load = load_orbax if spec.format == "orbax" else load_hf
    _, params = load(spec.folder, dtype)
    return spec.config, params, spec.tokenizer


# ------------------------------------------------------------------------------------ one stage


def stage_leaves(config: LlamaConfig, is_first: bool, is_last: bool) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The leaves outside the decoder layers (path, shape) a stage needs: embedding / head at the ends."""
    tied = config.tie_word_embeddings
    for path, leaf in _leaf_paths({k: v for k, v in _expected_params(config).items() if k != "layers"}):
        top = path[0]
        if (top == "embed" and (is_first or (is_last and tied))) or (top in ("norm", "lm_head") and is_last):
            yield path, leaf  # tied: embed is the head


def load_stage_params(spec: ModelSpec, layers: tuple[int, int], is_first: bool, is_last: bool,
                      quantization: str | None = None) -> Params:
    """Host (numpy) params of one pipeline stage, in `spec.config.dtype` except fp8 decoder-layer
    kernels (stored so, or `quantization="fp8"`), which come with their `kernel_scale`; reads nothing else.
    The stage's layers are one stacked tree, or a list of them where its layers are runs of both kinds;
    an MoE layer's per-expert tensors are stacked as they are read, one stage at a time."""
    config = spec.config
    read_scales = None
    if spec.format == "orbax":
        if len(config.layer_runs()) > 1:
            raise ModelLoadError(f"{spec.folder}: orbax folders of models with both dense and MoE layers are not "
                                 "supported; load the Hugging Face folder")
        read = _orbax_reader(spec.folder / ORBAX_PARAMS_DIR)
    else:
        tensors = open_shards(spec.folder)

        def read(path: tuple[str, ...], shape: tuple[int, ...], rows: range | None) -> np.ndarray:
            return _read_hf_leaf(tensors, spec.folder, config, path, shape, rows)

        def read_scales(path: tuple[str, ...], rows: range, kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return read_hf_fp8_kernel(tensors, spec.folder, path, rows, kernel,
                                      lambda p, layer, expert: _hf_names(config, p, layer, expert)[0],
                                      _experts_of(config, path))

    target = _NP_DTYPES[config.dtype]
    params: dict[str, Any] = {}
    for path, leaf in stage_leaves(config, is_first, is_last):
        _set(params, path, np.asarray(read(path, leaf.shape, None)).astype(target, copy=False))
    runs = []
    for rows, one_layer in _layer_runs_of(config, layers):
        run: dict[str, Any] = {}
        for path, leaf in _leaf_paths(one_layer):
            value = np.asarray(read(("layers", *path), (len(rows), *leaf.shape), rows))
            for name, array in _weight_leaves(spec, path, value, rows, quantization, read_scales, target):
                _set(run, (*path[:-1], name), array)
        runs.append(run)
    params["layers"] = runs[0] if len(runs) == 1 else runs
    return params


def _weight_leaves(spec: ModelSpec, path: tuple[str, ...], value: np.ndarray, rows: range,
                   quantization: str | None, read_scales: Any, target: Any) -> list[tuple[str, np.ndarray]]:
    """One decoder leaf as stored: as it is, or an fp8 `kernel` with its `kernel_scale` (stored fp8, or
    `--quantization fp8` of a Linear's kernel; an MoE router stays in the model dtype, as in vLLM)."""
    if value.dtype in FP8_NP:
        if value.dtype != FP8_WEIGHT_DTYPE or path[-1] != "kernel" or read_scales is None:
            raise ModelLoadError(f"{spec.folder}: layers.{'.'.join(path)} is stored in {value.dtype}; only "
                                 "decoder-layer Linear weights in float8_e4m3 (F8_E4M3) are supported")
        kernel, scale = read_scales(("layers", *path), rows, value)  # block-wise fp8: requantized per channel
        return [("kernel", kernel), ("kernel_scale", scale)]
    if quantization == "fp8" and path[-1] == "kernel" and path[-2] != "gate":
        kernel, scale = quantize_fp8_per_channel(value)
        return [("kernel", kernel), ("kernel_scale", scale)]
    keep_f32 = path[-1] == "e_score_correction_bias"  # DeepSeek-V3's selection bias: float32, as transformers
    return [(path[-1], value.astype(np.float32 if keep_f32 else target, copy=False))]


KV_SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"),               # vLLM's, compressed-tensors
                  ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                  ("self_attn.kv_scale", "self_attn.kv_scale"))           # older checkpoints: one for both


def load_kv_scales(spec: ModelSpec, layers: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """[stage layers] float32 K and V scales of an fp8 KV cache from the checkpoint (a layer without
    them: 1.0), or None when it has none (orbax folders never do)."""
    if spec.format != "hf":
        return None
    tensors = open_shards(spec.folder)
    k_scales, v_scales, found = [], [], False
    for layer in range(*layers):
        pair = (1.0, 1.0)
        for k_name, v_name in KV_SCALE_NAMES:
            k_full, v_full = f"model.layers.{layer}.{k_name}", f"model.layers.{layer}.{v_name}"
            if k_full in tensors and v_full in tensors:
                pair = (float(np.asarray(tensors[k_full].get(k_full), np.float32).reshape(-1)[0]),
                        float(np.asarray(tensors[v_full].get(v_full), np.float32).reshape(-1)[0]))
                if not (pair[0] > 0 and pair[1] > 0 and np.isfinite(pair).all()):
                    raise ModelLoadError(f"{spec.folder}: {k_full} / {v_full} = {pair}: KV-cache scales must be "
                                         "finite and > 0")
                found = True
                break
        k_scales.append(pair[0])
        v_scales.append(pair[1])
    return (np.asarray(k_scales, np.float32), np.asarray(v_scales, np.float32)) if found else None


def _orbax_reader(params_dir: Path) -> Any:
    import tensorstore as ts

    if not params_dir.is_dir():
        raise ModelLoadError(f"{params_dir}: orbax params directory not found")

    def read(path: tuple[str, ...], shape: tuple[int, ...], rows: range | None) -> np.ndarray:
        name = ".".join(path)
        try:
            array = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{params_dir}",
                                                           "path": name}}).result()
            part = array if rows is None else array[rows.start:rows.stop]
            value = part.read().result()
        except Exception as e:  # tensorstore raises ValueError subclasses with the storage's own words
            raise ModelLoadError(f"{params_dir}: cannot read {name} ({e})") from None
        want = shape if rows is None else (len(rows), *shape[1:])
        if tuple(value.shape) != tuple(want):
            raise ModelLoadError(f"{params_dir}: {name} has shape {list(value.shape)}, config.json implies "
                                 f"{list(want)}")
        return value

    return read
