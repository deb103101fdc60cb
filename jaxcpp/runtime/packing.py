"""The device half of packing (see `jaxcpp.core.step_input.pack`): inside a stage's jitted program, the one
int32 buffer is cut back into the step's named arrays and bit-cast to their dtypes. The program reads
the fields it needs and XLA drops the others."""

from __future__ import annotations

import jax
import numpy as np

from jaxcpp.core.step_input import Layout


def unpack(buf: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for f in layout:
        size = int(np.prod(f.shape, dtype=np.int64))
        part = buf[offset:offset + size]
        out[f.name] = jax.lax.bitcast_convert_type(part, f.dtype).reshape(f.shape)
        offset += size
    return out
