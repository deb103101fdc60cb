"""Build the executor for a planned engine: check devices, load each stage's own layers, place them.

The head has already sized everything (`jaxcpp.sizing.EngineSizing`); this is the device side's half,
the only module the engine imports (lazily) to get a real executor. It also says which dtype `auto`
means on this backend, since only the device side knows the backend.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxcpp.config import EngineConfig
from jaxcpp.executor import Executor
from jaxcpp.kernels.backend import select_attention
from jaxcpp.kernels.metadata import AttentionFn
from jaxcpp.models.checkpoint import load_kv_scales, load_stage_params
from jaxcpp.runtime.mesh import make_mesh, stage_mesh
from jaxcpp.runtime.pipeline import PipelineExecutor
from jaxcpp.runtime.stage import KVCacheSettings, Stage
from jaxcpp.sizing import EngineSizing

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
    """`--dtype auto` means the checkpoint's, except on CPU: float32 there, since bfloat16 matmuls on
    the CPU backend are emulated and run several times slower. An explicit dtype is always honoured."""
    backend = backend or jax.default_backend()
    if requested == "auto" and backend == "cpu":
        log.info("--dtype auto on the CPU backend: float32 (bfloat16 is emulated there; "
                 "give --dtype bfloat16 to keep the checkpoint's)")
        return "float32"
    return requested


def build_executor(config: EngineConfig, sizing: EngineSizing) -> Executor:
    """`--distributed-executor-backend mp`: one process per stage (`MultiProcessExecutor`); otherwise
    P stages in this process (P = 1 is the single-device case). Each stage loads only its layers."""
    if config.parallel.executor_backend == "mp":
        from jaxcpp.runtime.mp_executor import MultiProcessExecutor

        return MultiProcessExecutor(config, sizing)
    return build_inproc_executor(config, sizing)


def build_inproc_executor(config: EngineConfig, sizing: EngineSizing) -> PipelineExecutor:
    enable_compilation_cache()
    attention_fn = select_attention(config.model.attention_backend)
    p = config.parallel
    num_stages = p.pipeline_parallel_size
    mesh = make_mesh(num_stages, p.tensor_parallel_size)
    model = sizing.spec.config
    start = time.perf_counter()
    stages = [load_stage(s, num_stages, config, sizing, stage_mesh(mesh, s), attention_fn)
              for s in range(num_stages)]
    log.info("weights loaded: %s (%s, %d layers, %s%s) on %d stage(s), layers per stage %s, in %.1fs",
             sizing.spec.name, model.architecture, model.num_hidden_layers, model.dtype,
             ", fp8 decoder weights" if config.model.quantization else "", num_stages,
             [end - begin for begin, end in sizing.layers], time.perf_counter() - start)
    return PipelineExecutor(stages, p.trace_file)


def load_stage(index: int, num_stages: int, config: EngineConfig, sizing: EngineSizing, mesh: Any,
               attention_fn: AttentionFn) -> Stage:
    """Stage `index` with its own layers (host memory: this stage only) and its KV pages, as sized; the
    in-process executor and every stage process build their stage here, so the cache dtype and scales
    agree. Logs the stage's weight and KV-cache memory."""
    layers = sizing.layers[index]
    is_first, is_last = index == 0, index == num_stages - 1
    params = load_stage_params(sizing.spec, layers, is_first, is_last, config.model.quantization)
    stage = Stage(index, num_stages, mesh, sizing.spec.config, params, layers, sizing.num_pages, sizing.page_size,
                  attention_fn, sizing.shape.max_num_seqs, sizing.token_buckets[-1],
                  kv_cache_settings(config, sizing, layers))
    weight_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(params))
    kv_bytes = stage.kv.k.nbytes + stage.kv.v.nbytes
    log.info("stage %d memory: weights %.1f MiB (%s), KV cache %.1f MiB (%d pages, %s)", index,
             weight_bytes / 2**20, _weight_dtypes(params), kv_bytes / 2**20, sizing.num_pages, sizing.kv_cache_dtype)
    return stage


def kv_cache_settings(config: EngineConfig, sizing: EngineSizing, layers: tuple[int, int]) -> KVCacheSettings:
    """The pages' dtype, and for fp8 pages the checkpoint's k_scale/v_scale (else 1.0) or, with
    --calculate-kv-scales, scales to be set by the first prefill."""
    if not config.cache.is_fp8:
        return KVCacheSettings(sizing.kv_cache_dtype)
    if config.cache.calculate_kv_scales:
        return KVCacheSettings(sizing.kv_cache_dtype, calculate_scales=True)
    scales = load_kv_scales(sizing.spec, layers)
    return KVCacheSettings(sizing.kv_cache_dtype, *(scales or (None, None)))


def _weight_dtypes(params: Any) -> str:
    """"float32" or e.g. "float8_e4m3fn + float32": the dtypes the stage's weights are held in."""
    return " + ".join(sorted({np.asarray(x).dtype.name for x in jax.tree_util.tree_leaves(params)}, reverse=True))
