"""A step's small host arrays packed into one int32 buffer, so each stage receives one transfer, not 14.

`device_put` costs tens of microseconds per array in Python, whatever the array's size; a step has
14 arrays (token ids, metadata, sampling parameters) and a pipeline puts them on P stages per
micro-batch. Every StepInput field is 4 bytes wide (int32, uint32, float32), so the fields are viewed
as int32, concatenated on the host once per step, and cut apart and bit-cast back inside each stage's
jitted program, which reads the fields it needs (XLA drops the others). The layout (names, shapes,
dtypes) is a static argument: it follows from the bucket, so it adds no programs beyond the one per
bucket.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxcpp.step_input import StepInput


class Field(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # hashable, so a layout can be a static jit argument


Layout = tuple[Field, ...]


_KEYS = tuple(f.name for f in dataclasses.fields(StepInput))


def pack(step: StepInput) -> tuple[np.ndarray, Layout]:
    """All fields of `step` as one flat int32 array ([sum of sizes]) and how to cut it apart."""
    arrays = [np.asarray(getattr(step, k)) for k in _KEYS]
    for k, a in zip(_KEYS, arrays, strict=True):
        if a.dtype.itemsize != 4:
            raise TypeError(f"StepInput.{k} is {a.dtype}; packing needs 4-byte fields")
    buf = np.concatenate([a.reshape(-1).view(np.int32) for a in arrays])
    return buf, tuple(Field(k, a.shape, a.dtype) for k, a in zip(_KEYS, arrays, strict=True))


def unpack(buf: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """Inside jit: the packed buffer back into named arrays of their own shapes and dtypes."""
    out, offset = {}, 0
    for f in layout:
        size = int(np.prod(f.shape, dtype=np.int64))
        part = buf[offset:offset + size]
        out[f.name] = jax.lax.bitcast_convert_type(part, f.dtype).reshape(f.shape)
        offset += size
    return out
