"""Load a model for the engine and build the executor that runs it.

Sizes that follow from the model and the flags are decided here once: the max model length, the
pages per sequence, the number of KV pages, the token buckets.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxcpp.buckets import token_buckets
from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.kernels.backend import select_attention
from jaxcpp.models.checkpoint import resolve_model
from jaxcpp.models.config import LlamaConfig
from jaxcpp.runtime.executor import Executor, SingleDeviceExecutor
from jaxcpp.runtime.mesh import stage_layers
from jaxcpp.runtime.model_runner import ModelRunner
from jaxcpp.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: LlamaConfig
    params: Any
    tokenizer: Tokenizer
    dtype_name: str
    max_model_len: int
    pages_per_seq: int
    num_pages: int
    token_buckets: list[int]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.config.eos_token_ids)


def enable_compilation_cache() -> None:
    """A persistent XLA cache makes restarts (and repeated test engines) skip compiles."""
    path = os.environ.get("JAXCPP_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/jaxcpp/xla"))
    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_dtype(requested: str, backend: str) -> str:
    """`--dtype auto` means the checkpoint's, except on CPU: float32 there, since bfloat16 matmuls on
    the CPU backend are emulated and run several times slower. An explicit dtype is always honoured."""
    if requested == "auto" and backend == "cpu":
        log.info("--dtype auto on the CPU backend: float32 (bfloat16 is emulated there; "
                 "give --dtype bfloat16 to keep the checkpoint's)")
        return "float32"
    return requested


def load_model(config: EngineConfig) -> LoadedModel:
    enable_compilation_cache()
    start = time.perf_counter()
    dtype_name = resolve_dtype(config.model.dtype, jax.default_backend())
    model_config, params, tokenizer = resolve_model(config.model.model, dtype_name)
    # Host copies: staging places them, so no full copy lingers on device 0.
    params = jax.tree_util.tree_map(np.asarray, params)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    log.info("weights loaded: %s (%s, %d layers, %s) in %.1fs", config.model.model, model_config.architecture,
             model_config.num_hidden_layers, dtype, time.perf_counter() - start)
    max_model_len = config.model.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(f"--max-model-len: {max_model_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings}")
    page_size = config.cache.block_size
    pages_per_seq = -(-max_model_len // page_size)
    num_pages = _num_pages(config, model_config, pages_per_seq, dtype.itemsize)
    buckets = token_buckets(config.scheduler.max_num_batched_tokens, page_size)
    return LoadedModel(config.model.model, model_config, params, tokenizer, str(dtype), max_model_len,
                       pages_per_seq, num_pages, buckets)


def _num_pages(config: EngineConfig, model: LlamaConfig, pages_per_seq: int, itemsize: int) -> int:
    if config.cache.num_pages is not None:
        num_pages = config.cache.num_pages
    else:
        page_bytes = (2 * _largest_stage_layers(config, model) * config.cache.block_size
                      * model.num_key_value_heads * model.head_dim * itemsize)
        budget = int(config.cache.kv_cache_memory_gb * 2**30) // max(1, page_bytes)
        # More pages than every sequence at full length can use would only waste memory.
        num_pages = min(budget, config.scheduler.max_num_seqs * pages_per_seq + 1)
    if num_pages < pages_per_seq + 1:
        raise ConfigError(f"--num-pages: {num_pages} pages cannot hold one sequence of --max-model-len "
                          f"({pages_per_seq} pages of {config.cache.block_size} tokens, plus the reserved page)")
    return num_pages


def _largest_stage_layers(config: EngineConfig, model: LlamaConfig) -> int:
    """Every stage holds the same number of pages, so the stage with the most layers sizes them."""
    p = config.parallel
    partition = p.partition_list() if p.pp_partition is not None else None
    return max(end - start for start, end in stage_layers(model.num_hidden_layers, p.pipeline_parallel_size,
                                                          partition))


def build_executor(config: EngineConfig, model: LoadedModel) -> Executor:
    attention_fn = select_attention(config.model.attention_backend)
    p = config.parallel
    if p.pipeline_parallel_size * p.tensor_parallel_size > 1:
        from jaxcpp.runtime.pipeline import build_pipeline_executor

        return build_pipeline_executor(config, model, attention_fn)
    runner = ModelRunner(model.config, model.params, model.num_pages, config.cache.block_size, attention_fn)
    return SingleDeviceExecutor(runner)
