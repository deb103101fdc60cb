"""Checkpoint I/O: Hugging Face folders (config.json + safetensors shards) and jaxcpp's orbax folders.

Loading builds the expected params tree from the config (`jax.eval_shape(init_params)`), then fills each
leaf from the HF tensor(s) it corresponds to: Linear weights are transposed (`[out, in]` -> `[in, out]`)
and per-layer tensors are stacked on a leading `[L]` axis. Tensors are read with a small memory-mapped
safetensors reader because `safetensors.numpy` cannot represent bfloat16. Orbax folders hold
`config.json` (HF format, so the same parser reads both) beside `params/`. `resolve_model` turns a
CLI model name into (config, params, tokenizer). Every failure is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import CONFIG_FILE, LlamaConfig
from jaxcpp.models.llama import Params, init_params
from jaxcpp.tokenizer import Tokenizer, load_tokenizer

BUNDLED_MODELS = {"tiny": Path(__file__).resolve().parent / "checkpoints" / "tiny"}
INDEX_FILE = "model.safetensors.index.json"
ORBAX_PARAMS_DIR = "params"
_ST_DTYPES: dict[str, Any] = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------------------------------- name mapping


def _hf_names(path: tuple[str, ...], layer: int | None) -> tuple[str, bool]:
    """(HF tensor name, transpose?) of one leaf of our tree; `layer` for the stacked decoder leaves."""
    if path == ("embed",):
        return "model.embed_tokens.weight", False
    if path == ("norm",):
        return "model.norm.weight", False
    if path == ("lm_head",):
        return "lm_head.weight", True
    assert path[0] == "layers" and layer is not None, path
    *modules, leaf = path[1:]
    hf_leaf = {"kernel": "weight", "scale": "weight", "bias": "bias"}[leaf]
    return f"model.layers.{layer}.{'.'.join(modules)}.{hf_leaf}", leaf == "kernel"


def _leaf_paths(tree: Params) -> Iterator[tuple[tuple[str, ...], Any]]:
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield tuple(k.key for k in keypath), leaf


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------------- safetensors


class _SafetensorsFile:
    """Header + memory map of one .safetensors file (format: u64 header size, JSON header, raw data)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path}: not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        for name, info in header.items():
            self._check_entry(name, info)
        self.header: dict[str, Any] = header

    def _check_entry(self, name: str, info: Any) -> None:
        """Each tensor's entry is well formed and its bytes lie inside the file (a truncated file
        fails here, naming the tensor, not as a reshape error deep in numpy)."""
        try:
            dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, start, end)) and start <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has a malformed header entry {info!r}")
        if dtype not in _ST_DTYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        if end > self._data.size:
            raise ModelLoadError(f"{self.path}: tensor {name!r} ends at byte {end} of the data but the file "
                                 f"holds {self._data.size}: the file is truncated")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if end - start != expected:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has {end - start} bytes, its shape {shape} "
                                 f"and dtype {dtype} need {expected}")

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]  # checked by _check_entry
        start, end = info["data_offsets"]
        return self._data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _open_shards(folder: Path) -> dict[str, _SafetensorsFile]:
    """Tensor name -> the shard holding it (via the index file when there is one)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: bad index file ({e!r})") from None
        shards = {name: folder / name for name in sorted(set(weight_map.values()))}
        for path in shards.values():
            if not path.is_file():
                raise ModelLoadError(f"{path}: shard listed in {INDEX_FILE} not found")
        files = {name: _SafetensorsFile(path) for name, path in shards.items()}
        return {tensor: files[shard] for tensor, shard in weight_map.items()}
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (nor {INDEX_FILE})")
    by_name: dict[str, _SafetensorsFile] = {}
    for path in paths:
        f = _SafetensorsFile(path)
        by_name.update({name: f for name in f.header})
    return by_name


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
    tensors = _open_shards(folder)
    expected = _expected_params(config)
    params: dict[str, Any] = {}
    for path, leaf in _leaf_paths(expected):
        layers = [None] if path[0] != "layers" else list(range(config.num_hidden_layers))
        stacked = []
        for layer in layers:
            name, transpose = _hf_names(path, layer)
            if name not in tensors:
                raise ModelLoadError(f"{folder}: tensor {name!r} missing from the safetensors files")
            array = tensors[name].get(name)
            array = array.T if transpose else array
            want = leaf.shape if layer is None else leaf.shape[1:]
            if tuple(array.shape) != tuple(want):
                raise ModelLoadError(f"{tensors[name].path}: tensor {name!r} has shape {list(array.shape)}, "
                                     f"config.json implies {list(want)}")
            stacked.append(array)
        value = stacked[0] if layers == [None] else np.stack(stacked)
        _set(params, path, jnp.asarray(value))
    return config, _cast(params, dtype)


def save_hf(folder: str | Path, params: Params, config: LlamaConfig) -> None:
    """Write config.json + model.safetensors that `transformers` loads (`from_pretrained(folder)`)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, leaf in _leaf_paths(params):
        array = np.asarray(leaf)
        for layer in ([None] if path[0] != "layers" else range(array.shape[0])):
            name, transpose = _hf_names(path, layer)
            value = array if layer is None else array[layer]
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
    """'tiny' (bundled), an orbax folder from `save_orbax`, or a Hugging Face folder."""
    folder = BUNDLED_MODELS.get(str(name_or_path), Path(name_or_path))
    if not folder.is_dir():
        raise ModelLoadError(f"{name_or_path}: neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
                             "nor an existing folder")
    if (folder / ORBAX_PARAMS_DIR).is_dir():
        config, params = load_orbax(folder, dtype)
    else:
        config, params = load_hf(folder, dtype)
    if dtype not in (None, "auto"):
        config = config.replace(dtype=dtype)
    return config, params, load_tokenizer(folder, config)
