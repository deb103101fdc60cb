"""The device mesh of a pipeline: axes ("pp", "tp"), one row of devices per stage, and the layer split.

    mesh = make_mesh(P, T)              # P x T devices, checked against what this process sees
    stage_mesh(mesh, s)                 # stage s's devices as a 1-D ("tp",) mesh

Everything a stage owns (its params, its KV pages, its programs) lives on its own row of the mesh;
tensor parallelism happens inside a row, the pipeline between rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcpp.config import ConfigError

MESH_AXES = ("pp", "tp")


def check_devices(pp: int, tp: int, devices: Sequence[Any] | None = None) -> list[Any]:
    """The first P x T devices, or a ConfigError that says how many exist and how to get more on CPU."""
    devices = list(jax.devices() if devices is None else devices)
    need = pp * tp
    if len(devices) < need:
        platform = devices[0].platform if devices else jax.default_backend()
        raise ConfigError(
            f"--pipeline-parallel-size {pp} x --tensor-parallel-size {tp} needs {need} devices, but this "
            f"process sees {len(devices)} {platform} device(s). To test on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} (or more) before jax is imported.")
    return devices[:need]


def make_mesh(pp: int, tp: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("pp", "tp") mesh: row s holds stage s's T devices (neighbours in device order, so on a GPU
    node a stage's tensor-parallel group shares the fastest links)."""
    chosen = check_devices(pp, tp, devices)
    return Mesh(np.array(chosen, dtype=object).reshape(pp, tp), MESH_AXES)


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """Stage `stage`'s row of the mesh as a 1-D ("tp",) mesh: its params, pages and programs live here."""
    return Mesh(mesh.devices[stage], ("tp",))
