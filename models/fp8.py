"""FP8 decoder weights: the per-output-channel quantization `--quantization fp8` applies at load, and the
`weight_scale` tensors an fp8 checkpoint stores beside its F8_E4M3 Linear weights (per tensor or per
output channel; an MoE layer's per expert). Host side: numpy only.

Block-wise fp8 (DeepSeek-V3, Kimi-K2: `weight_scale_inv` [ceil(out/B), ceil(in/B)], B = 128, a float32
multiplier a block): each weight is dequantized block by block at load and quantized again with one
scale per output channel (as tpu-inference does), so the model runs the one fp8 layout it has. The
cost: a channel's scale now covers all its blocks, so blocks with small values lose resolution (at most
the ratio of the channel's largest block scale to the block's own; measured on a test checkpoint in
tests/models/test_fp8_blockwise.py). Activations are not quantized (the checkpoint's "dynamic"
activation scheme is for fp8 matmuls; ours run in the model dtype after the weight is dequantized)."""

from __future__ import annotations

import json
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


DEFAULT_BLOCK = 128  # DeepSeek-V3's weight_block_size


def weight_block_size(folder: Path) -> int:
    """config.json's quantization_config.weight_block_size (square blocks), else DeepSeek's 128."""
    try:
        quant = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return DEFAULT_BLOCK
    size = quant.get("weight_block_size") or [DEFAULT_BLOCK, DEFAULT_BLOCK]
    if not (isinstance(size, list) and len(size) == 2 and size[0] == size[1] and isinstance(size[0], int)):
        raise ModelLoadError(f"{folder / 'config.json'}: quantization_config.weight_block_size: square blocks "
                             f"[B, B] are supported, got {size!r}")
    return size[0]


def requantize_blockwise(kernel: np.ndarray, scale_inv: np.ndarray, block: int = DEFAULT_BLOCK
                         ) -> tuple[np.ndarray, np.ndarray]:
    """One fp8 kernel [in, out] (transposed from the checkpoint's [out, in]) with its block multipliers
    [ceil(out/B), ceil(in/B)] -> per-output-channel fp8 (`quantize_fp8_per_channel`)."""
    fan_in, fan_out = kernel.shape
    if scale_inv.shape != (-(-fan_out // block), -(-fan_in // block)):
        raise ValueError(f"weight_scale_inv of shape {list(scale_inv.shape)} does not tile a [{fan_out}, {fan_in}] "
                         f"weight in {block} x {block} blocks")
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), block, 0), block, 1)[:fan_out, :fan_in]  # [out, in]
    return quantize_fp8_per_channel(kernel.astype(np.float32) * full.T)


def read_hf_fp8_kernel(tensors: dict[str, Any], folder: Path, path: tuple[str, ...], rows: range, kernel: np.ndarray,
                       weight_name: Any, experts: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """A stacked fp8 kernel [len(rows), (E,) in, out] as stored and its per-output-channel scales: the
    `weight_scale` beside it, or, block-wise (`weight_scale_inv`), each layer's (expert's) kernel
    requantized per channel."""
    first = weight_name(path, rows[0], experts[0]) + "_scale_inv"
    if first not in tensors:
        return kernel, read_hf_weight_scales(tensors, folder, path, rows, kernel.shape[-1], weight_name, experts)
    flat = kernel.reshape(-1, *kernel.shape[-2:])
    block = weight_block_size(folder)
    out_kernels, out_scales = [], []
    for i, (layer, expert) in enumerate((layer, expert) for layer in rows for expert in experts):
        name = weight_name(path, layer, expert) + "_scale_inv"
        if name not in tensors:
            raise ModelLoadError(f"{folder}: {name!r} is missing (block-wise fp8: every fp8 weight needs one)")
        try:
            q, scale = requantize_blockwise(flat[i], np.asarray(tensors[name].get(name), np.float32), block)
        except ValueError as e:
            raise ModelLoadError(f"{tensors[name].path}: {name!r}: {e}") from None
        out_kernels.append(q)
        out_scales.append(scale)
    return (np.stack(out_kernels).reshape(kernel.shape),
            np.stack(out_scales).reshape(*kernel.shape[:-2], kernel.shape[-1]))


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
            raise ModelLoadError(f"{folder}: {weight} is fp8 but {name!r} (or {name + '_inv'!r}) is missing")
        scale = np.asarray(tensors[name].get(name), np.float32).reshape(-1)
        if scale.size not in (1, out_features):
            raise ModelLoadError(f"{tensors[name].path}: {name!r} has {scale.size} values; per-tensor (1) or "
                                 f"per-output-channel ({out_features}) scales are supported")
        stacked.append(np.broadcast_to(scale, (out_features,)))
    shape = (len(rows), out_features) if experts == [None] else (len(rows), len(experts), out_features)
    return np.stack(stacked).astype(np.float32).reshape(shape)
