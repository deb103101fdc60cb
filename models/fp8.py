"""FP8 decoder weights: the per-output-channel quantization `--quantization fp8` applies at load, and the
`weight_scale` tensors an fp8 checkpoint stores beside its F8_E4M3 Linear weights (per tensor or per
output channel; an MoE layer's per expert). Host side: numpy only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxcpp.errors import ModelLoadError

FP8_WEIGHT_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def quantize_fp8_per_channel(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., in, out] float -> (the same shape in float8_e4m3fn, [..., out] float32 scales): each output
    channel's largest |w| maps to 448; kernel ~= fp8 * scale. A channel of zeros gets scale 1."""
    w = kernel.astype(np.float32)
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    quantized = np.clip(w / scale[..., None, :], -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_WEIGHT_DTYPE)
    return quantized, scale


def read_hf_weight_scales(tensors: dict[str, Any], folder: Path, path: tuple[str, ...],
                           rows: range, out_features: int, weight_name: Any, experts: list[int | None]
                           ) -> np.ndarray:
    """[len(rows), out] float32 ([len(rows), E, out] for experts): each layer's (expert's)
    `<linear>.weight_scale`, per tensor or per output channel."""
    stacked = []
    for layer, expert in ((layer, expert) for layer in rows for expert in experts):
        weight = weight_name(path, layer, expert)
        name = weight + "_scale"
        if name not in tensors:
            hint = (" (block-wise fp8 with weight_scale_inv is not supported)" if weight + "_scale_inv" in tensors
                    else "")
            raise ModelLoadError(f"{folder}: {weight} is fp8 but {name!r} is missing{hint}")
        scale = np.asarray(tensors[name].get(name), np.float32).reshape(-1)
        if scale.size not in (1, out_features):
            raise ModelLoadError(f"{tensors[name].path}: {name!r} has {scale.size} values; per-tensor (1) or "
                                 f"per-output-channel ({out_features}) scales are supported")
        stacked.append(np.broadcast_to(scale, (out_features,)))
    shape = (len(rows), out_features) if experts == [None] else (len(rows), len(experts), out_features)
    return np.stack(stacked).astype(np.float32).reshape(shape)
