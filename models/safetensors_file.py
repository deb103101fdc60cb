"""A small memory-mapped safetensors reader: `safetensors.numpy` cannot represent bfloat16 (nor fp8).

    SafetensorsFile(path)  one file's header, checked entry by entry (a truncated or malformed file fails
                           naming the tensor), and its tensors as views of the memory map (`get`)
    open_shards(folder)    tensor name -> the file holding it, through the index file when there is one

Only the tensors read are paged in: a pipeline stage reads its own layers (`jaxcpp.models.checkpoint`).
Every failure is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxcpp.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
ST_DTYPES: dict[str, Any] = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
FP8_NP = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


class SafetensorsFile:
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
        if dtype not in ST_DTYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        if end > self._data.size:
            raise ModelLoadError(f"{self.path}: tensor {name!r} ends at byte {end} of the data but the file "
                                 f"holds {self._data.size}: the file is truncated")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(ST_DTYPES[dtype]).itemsize
        if end - start != expected:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has {end - start} bytes, its shape {shape} "
                                 f"and dtype {dtype} need {expected}")

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]  # checked by _check_entry
        start, end = info["data_offsets"]
        return self._data[start:end].view(ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def open_shards(folder: Path) -> dict[str, SafetensorsFile]:
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
        files = {name: SafetensorsFile(path) for name, path in shards.items()}
        return {tensor: files[shard] for tensor, shard in weight_map.items()}
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (nor {INDEX_FILE})")
    by_name: dict[str, SafetensorsFile] = {}
    for path in paths:
        f = SafetensorsFile(path)
        by_name.update({name: f for name in f.header})
    return by_name
