"""Build the in-process executor: resolve the dtype on this backend, size the engine, check devices,
load each stage's own layers, place them.

The module the engine imports (lazily) for a pipeline in its own process; a multi-process pipeline's
head never imports it (`jaxcpp.head.mp_executor`: its stages resolve the backend, the head holds none).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import jax

from jaxcpp.config import EngineConfig
from jaxcpp.core.sizing import EngineSizing, dtype_on_backend
from jaxcpp.kernels.backend import select_attention
from jaxcpp.models.checkpoint import load_stage_params
from jaxcpp.models.spec import ModelSpec
from jaxcpp.runtime.mesh import make_mesh, stage_mesh
from jaxcpp.runtime.pipeline import PipelineExecutor
from jaxcpp.runtime.stage import Stage

log = logging.getLogger(__name__)


def compilation_cache_dir(env: Mapping[str, str] = os.environ) -> str | None:
    """Where the persistent XLA cache lives: `JAXCPP_COMPILATION_CACHE_DIR` (empty: no cache), else
    `$XDG_CACHE_HOME/jaxcpp/xla`, else `~/.cache/jaxcpp/xla` (the XDG default)."""
    if "JAXCPP_COMPILATION_CACHE_DIR" in env:
        return env["JAXCPP_COMPILATION_CACHE_DIR"] or None
    cache_home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "jaxcpp", "xla")


def enable_compilation_cache() -> None:
    """A persistent XLA cache makes restarts (and repeated test engines) skip compiles."""
    path = compilation_cache_dir()
    if path and not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
    enable_compilation_cache()
    attention_fn = select_attention(config.model.attention_backend)
    p = config.parallel
    num_stages = p.pipeline_parallel_size
    mesh = make_mesh(num_stages, p.tensor_parallel_size)
    model = sizing.spec.config
    start, stages = time.perf_counter(), []
    for s, layers in enumerate(sizing.layers):
        is_first, is_last = s == 0, s == num_stages - 1
        params = load_stage_params(sizing.spec, layers, is_first, is_last)  # host memory: this stage only
        stages.append(Stage(s, num_stages, stage_mesh(mesh, s), model, params, layers,
                            sizing.num_pages, sizing.page_size, attention_fn, sizing.shape.max_num_seqs,
                            sizing.token_buckets[-1]))
    log.info("weights loaded: %s (%s, %d layers, %s) on %d stage(s), layers per stage %s, in %.1fs",
             sizing.spec.name, model.architecture, model.num_hidden_layers, model.dtype, num_stages,
             [end - begin for begin, end in sizing.layers], time.perf_counter() - start)
    return PipelineExecutor(stages, p.trace_file)
