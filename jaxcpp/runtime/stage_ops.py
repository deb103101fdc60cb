"""A stage's own work, whichever executor drives it: build it from its layers, compile its programs for
every bucket, time its attention-free forward. The in-process pipeline (`factory`, `pipeline`: P stages
in one process) and a stage process (`stage_process`: one stage) both call these.

    stage = build_stage(index, num_stages, mesh, config, sizing)   # its layers only; or the stand-in
    compile_buckets([stage, ...], shape, report)                   # COMPILE_THREADS buckets at a time;
                                                                   # report(BucketCompiled): cache hits too
    seconds, out = time_attention_free(stage, batch, hidden, first_use)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcpp.config import EngineConfig, KVSettings
from jaxcpp.core.kv_transfer import page_buckets
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.core.step_input import StepShape
from jaxcpp.kernels.backend import select_attention, select_mla_absorbed, select_mla_rebuilt
from jaxcpp.kernels.metadata import AttentionFn
from jaxcpp.models.checkpoint import load_kv_scales, load_stage_params
from jaxcpp.models.config import ModelConfig
from jaxcpp.models.mla import mla_attention_fn
from jaxcpp.runtime.mla_prefill import rebuild_weight
from jaxcpp.runtime.stage import KVCacheSettings, Stage, StageInput

log = logging.getLogger(__name__)

# Buckets compiled at once at warm-up: XLA's compile releases the GIL, so threads overlap on cores.
COMPILE_THREADS = int(os.environ.get("JAXCPP_COMPILE_THREADS", os.cpu_count() or 1))
COMPILE_NICENESS = 10  # added to a compile thread's nice value: see yield_to_other_threads


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


def build_stage(index: int, num_stages: int, mesh: Mesh, config: EngineConfig, sizing: EngineSizing) -> Any:
    """Stage `index` on `mesh`, from its own layers only (the host holds this stage's params alone), sized
    as the head planned; the timed stand-in (`stand_in.StandInStage`) when the config asks for one."""
    layers = sizing.layers[index]
    stand_in = config.parallel.stand_in_model()
    if stand_in is not None:
        from jaxcpp.runtime.stand_in import StandInStage

        return StandInStage(index, num_stages, mesh, layers, stand_in, config.parallel.stand_in_jitter,
                            sizing.spec.config.vocab_size, sizing.shape.max_num_seqs, config.model.seed)
    enable_compilation_cache()
    params = load_stage_params(sizing.spec, layers, index == 0, index == num_stages - 1, config.model.quantization)
    model = sizing.spec.config
    backend = config.model.attention_backend
    weight = (rebuild_weight(config.model.mla_prefill, model, mesh.devices.flat[0], sizing.token_buckets[-1],
                             sizing.page_size, backend) if model.is_mla else 1.0)
    stage = Stage(index, num_stages, mesh, model, params, layers, sizing.num_pages, sizing.page_size,
                  model_attention(model, backend, weight), sizing.shape.max_num_seqs,
                  sizing.token_buckets[-1], kv_cache_settings(config, sizing, layers), config.model.layer_weights,
                  weight)
    weight_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(params))
    kv_bytes = stage.kv.k.nbytes + stage.kv.v.nbytes
    latent = (f", latent rows of {model.kv_lora_rank} + {model.qk_rope_head_dim} values a token a layer"
              if model.is_mla else "")  # MLA: one row shared by all heads (core/sizing.py counts the same)
    log.info("stage %d memory: weights %.1f MiB (%s), KV cache %.1f MiB (%d pages, %s%s)", index,
             weight_bytes / 2**20, _weight_dtypes(params), kv_bytes / 2**20, sizing.num_pages, sizing.kv_cache_dtype,
             latent)
    if stage.per_layer_weights:  # runs its layers one after the other (--layer-weights; docs/benchmarks.md)
        log.info("stage %d holds each layer's weights apart (--layer-weights %s): about twice the compile time, "
                 "no copy out of a stack each step", index, config.model.layer_weights)
    return stage


def model_attention(model: ModelConfig, backend: str, mla_rebuild_weight: float = 1.0) -> AttentionFn:
    """`--attention-backend`'s op for the model's pages: ragged paged attention, or for an MLA model
    attention over latent pages with the backend's absorbed and rebuilt forms (the Pallas kernels on a
    GPU) and `--mla-prefill`'s rule for its prefill chunks (`mla_rebuild_weight`, runtime/mla_prefill.py)."""
    if model.is_mla:
        return mla_attention_fn(model, select_mla_absorbed(backend), select_mla_rebuilt(backend), mla_rebuild_weight)
    return select_attention(backend)


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


@dataclass(frozen=True)
class BucketCompiled:
    """One bucket's programs ready on every stage: `programs` looked up in the persistent compilation cache
    (0 without one), `from_cache` of them found there (a warm start) instead of compiled."""

    index: int          # from 1
    num_tokens: int
    seconds: float
    programs: int
    from_cache: int


_CACHE_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_cache_counts = threading.local()   # the compiling thread's {event: count}; jax records events on that thread
_cache_listener = threading.Lock()
_cache_listening = False


def _on_cache_event(event: str, **kwargs: Any) -> None:
    counts = getattr(_cache_counts, "value", None)
    if counts is not None and event in counts:
        counts[event] += 1


def _count_cache_events() -> dict[str, int]:
    """From now on, this thread's persistent-cache lookups and hits (reset for each bucket)."""
    global _cache_listening
    with _cache_listener:
        if not _cache_listening:
            jax.monitoring.register_event_listener(_on_cache_event)
            _cache_listening = True
    _cache_counts.value = {_CACHE_LOOKUP: 0, _CACHE_HIT: 0}
    return _cache_counts.value


def yield_to_other_threads() -> None:
    """Lower the calling thread's CPU priority by COMPILE_NICENESS (Linux: a thread's nice value is its own,
    and the threads it starts inherit it). The warm-up's compile threads fill every core for minutes; at the
    same priority they starve the process's other threads: jax.distributed's heartbeats and, in stage 0's
    process, the coordination service that watches them (a PP 2 server was aborted by its own failure
    detector while compiling), the control channel's reader, gRPC's health answers. Pinned or not (a pinned
    stage's threads share its cores), those threads now run first whenever they have work."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS))
    except OSError:  # not Linux, or not allowed: compiles at the same priority as before
        pass


def compile_buckets(stages: Sequence[Any], shape: StepShape, report: Callable[[BucketCompiled], None],
                    kv: KVSettings | None = None) -> None:
    """Every stage's program for every bucket, `COMPILE_THREADS` buckets at a time; `report(BucketCompiled)` as
    the i-th bucket (from 1) is ready on every stage, saying whether the persistent cache had its programs.
    With `kv` (disaggregation), also a producer's gather and a consumer's scatter program for every page
    bucket (`jaxcpp.core.kv_transfer`)."""
    buckets = shape.buckets

    def compile_bucket(num_tokens: int) -> tuple[int, float, dict[str, int]]:
        counts = _count_cache_events()
        start = time.perf_counter()
        for stage in stages:
            stage.compile(shape, num_tokens)
        return num_tokens, time.perf_counter() - start, counts

    with ThreadPoolExecutor(min(COMPILE_THREADS, len(buckets)), thread_name_prefix="jaxcpp-compile",
                            initializer=yield_to_other_threads) as pool:  # its threads end with the warm-up
        for i, (num_tokens, seconds, counts) in enumerate(pool.map(compile_bucket, buckets), 1):
            report(BucketCompiled(i, num_tokens, seconds, counts[_CACHE_LOOKUP], counts[_CACHE_HIT]))
    if kv is not None:
        for stage in stages:
            stage.compile_page_transfers(page_buckets(shape.pages_per_seq), kv.produces, kv.consumes)


def time_attention_free(stage: Any, batch: StageInput, hidden: Any, first_use: bool) -> tuple[float, Any]:
    """Seconds of `stage`'s attention-free forward (the calibration sweep's), timed around the model call
    only: its inputs and KV pages (so every micro-batch in flight) ready before the clock starts; and
    its output. `first_use`: the bucket's program is compiled and run once, untimed, first."""
    if first_use:
        jax.block_until_ready(stage.run_attention_free(batch, hidden))
    jax.block_until_ready((batch.packed, hidden, stage.kv))
    start = time.perf_counter()
    out = jax.block_until_ready(stage.run_attention_free(batch, hidden))
    return time.perf_counter() - start, out
