"""Build the in-process executor: resolve the dtype on this backend, size the engine, check devices,
load each stage's own layers, place them.

The module the engine imports (lazily) for a pipeline in its own process; a multi-process pipeline's
head never imports it (`jaxcpp.head.mp_executor`: its stages resolve the backend, the head holds none).
"""

from __future__ import annotations

import logging
import time

import jax

from jaxcpp.config import EngineConfig
from jaxcpp.core.sizing import EngineSizing, dtype_on_backend
from jaxcpp.models.spec import ModelSpec
from jaxcpp.runtime.mesh import make_mesh, stage_mesh
from jaxcpp.runtime.pipeline import PipelineExecutor
from jaxcpp.runtime.stage_ops import build_stage

log = logging.getLogger(__name__)


def resolve_dtype(requested: str, backend: str | None = None) -> str:
    """`dtype_on_backend` on this process's backend (or `backend`), said in the log when auto is float32."""
    resolved = dtype_on_backend(requested, backend or jax.default_backend())
    if resolved != requested:
        log.info("--dtype auto on the CPU backend: float32 (bfloat16 is emulated there; "
                 "give --dtype bfloat16 to keep the checkpoint's)")
    return resolved


def build_executor(config: EngineConfig, spec: ModelSpec) -> tuple[PipelineExecutor, EngineSizing]:
    """P stages in this process (P = 1 is the single-device case), each loading only its layers, and the
    sizing they run with (the dtype resolved on this backend)."""
    sizing = EngineSizing.plan(config, spec.with_dtype(resolve_dtype(config.model.dtype)))
    return build_inproc_executor(config, sizing), sizing


def build_inproc_executor(config: EngineConfig, sizing: EngineSizing) -> PipelineExecutor:
    p = config.parallel
    mesh = make_mesh(p.pipeline_parallel_size, p.tensor_parallel_size)
    model = sizing.spec.config
    start = time.perf_counter()
    stages = [build_stage(s, p.pipeline_parallel_size, stage_mesh(mesh, s), config, sizing)
              for s in range(p.pipeline_parallel_size)]
    log.info("weights loaded: %s (%s, %d layers, %s%s) on %d stage(s), layers per stage %s, in %.1fs",
             sizing.spec.name, model.architecture, model.num_hidden_layers, model.dtype,
             ", fp8 decoder weights" if config.model.quantization else "", len(stages),
             [end - begin for begin, end in sizing.layers], time.perf_counter() - start)
    return PipelineExecutor(stages, p.trace_file, config.kv_transfer.settings())

