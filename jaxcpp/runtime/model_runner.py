"""One jitted program per token bucket: forward the batch, take each sequence's last hidden state,
compute its logits and sample. Params are arguments (never closed over) and the KV pages are donated,
so the cache is updated in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.models import llama
from jaxcpp.runtime import compile_guard
from jaxcpp.runtime.sampler import sample
from jaxcpp.scheduler import SchedulerOutput
from jaxcpp.step_input import StepInput, StepShape, build_step_input

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    tokens: jax.Array  # [S] int32: the sampled token of each sequence (padding rows: garbage)
    logits: jax.Array  # [S, V] float32: kept on the device unless someone asks for them


def attention_metadata(batch: dict[str, jax.Array]) -> AttentionMetadata:
    return AttentionMetadata(*(batch[name] for name in AttentionMetadata._fields))


def logits_and_sample(params: Any, hidden: jax.Array, batch: dict[str, jax.Array],
                      config: llama.LlamaConfig) -> StepOutput:
    """The step's tail: each sequence's last hidden state ([T, D] -> [S, D]) -> logits -> a token."""
    logits = llama.compute_logits(params, hidden[batch["logits_indices"]], config)
    tokens = sample(logits, batch["temperature"], batch["top_k"], batch["top_p"],
                    batch["seeds"], batch["steps"])
    return StepOutput(tokens, logits)


def dummy_step(num_tokens: int, max_num_seqs: int, pages_per_seq: int) -> StepInput:
    """An all-padding batch of one token bucket, for warm-up compiles: what an empty schedule pads to, so
    warm-up compiles exactly the programs real steps use."""
    return build_step_input(SchedulerOutput(), StepShape([num_tokens], max_num_seqs, pages_per_seq, page_size=1))


def warm_up_buckets(run: Callable[[StepInput], object], token_buckets: list[int], max_num_seqs: int,
                    pages_per_seq: int, where: str = "") -> float:
    """Run (and so compile) one all-padding step per bucket, with a progress line each. Returns seconds."""
    compile_guard.install()
    log.info("compiling %d programs%s, one per token bucket %s ...", len(token_buckets), where, token_buckets)
    start = time.perf_counter()
    for i, num_tokens in enumerate(token_buckets, 1):
        t0 = time.perf_counter()
        run(dummy_step(num_tokens, max_num_seqs, pages_per_seq))
        log.info("compiled bucket %d/%d%s: %d tokens (%.1fs)", i, len(token_buckets), where, num_tokens,
                 time.perf_counter() - t0)
    return time.perf_counter() - start


class ModelRunner:
    """The whole model on one device: the P = 1, T = 1 executor's engine room."""

    def __init__(self, config: llama.LlamaConfig, params: Any, num_pages: int, page_size: int,
                 attention_fn: Any, device: Any = None) -> None:
        self.config = config
        self.device = device or jax.devices()[0]
        self.params = jax.device_put(params, self.device)
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        self.kv = jax.device_put(
            llama.make_kv_cache(config, config.num_hidden_layers, num_pages, page_size, dtype), self.device)
        self._attention_fn = attention_fn
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))

    def _step_fn(self, params: Any, kv: llama.KVCache, batch: dict[str, jax.Array]
                 ) -> tuple[StepOutput, llama.KVCache]:
        md = attention_metadata(batch)
        hidden, kv = llama.forward(params, batch["token_ids"], kv, md, self.config, self._attention_fn)
        return logits_and_sample(params, hidden, batch, self.config), kv

    def execute(self, step: StepInput) -> StepOutput:
        """Dispatch one step; returns at once with device arrays (JAX dispatches asynchronously)."""
        batch = jax.device_put(dict(step.__dict__), self.device)  # every host array in one transfer
        out, self.kv = self._step(self.params, self.kv, batch)
        return out

    def warmup(self, token_buckets: list[int], max_num_seqs: int, pages_per_seq: int) -> float:
        """Compile every bucket now, so serving never compiles. Returns the seconds it took."""
        return warm_up_buckets(lambda step: jax.block_until_ready(self.execute(step)), token_buckets,
                               max_num_seqs, pages_per_seq)
