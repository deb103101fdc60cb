"""One jitted program per token bucket: forward the batch, take each sequence's last hidden state,
compute its logits and sample. Params are arguments (never closed over) and the KV pages are donated,
so the cache is updated in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.models import llama
from jaxcpp.runtime import compile_guard
from jaxcpp.runtime.sampler import sample
from jaxcpp.step_input import StepInput

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    tokens: jax.Array  # [S] int32: the sampled token of each sequence (padding rows: garbage)
    logits: jax.Array  # [S, V] float32: kept on the device unless someone asks for them


def attention_metadata(batch: StepInput | dict[str, Any]) -> AttentionMetadata:
    get = batch.__getitem__ if isinstance(batch, dict) else lambda k: getattr(batch, k)
    return AttentionMetadata(*(get(name) for name in AttentionMetadata._fields))


def to_device(step: StepInput, device: Any = None, keys: Collection[str] | None = None
              ) -> dict[str, jax.Array]:
    """A step's host arrays (all, or those named in `keys`) in one transfer; `device` may be a Sharding."""
    arrays = step.__dict__ if keys is None else {k: getattr(step, k) for k in keys}
    return jax.device_put(dict(arrays), device)


SAMPLING_KEYS = ("logits_indices", "temperature", "top_k", "top_p", "seeds", "steps")


def logits_and_sample(params: Any, hidden: jax.Array, batch: dict[str, jax.Array],
                      config: llama.LlamaConfig) -> StepOutput:
    """The step's tail: each sequence's last hidden state ([T, D] -> [S, D]) -> logits -> a token."""
    logits = llama.compute_logits(params, hidden[batch["logits_indices"]], config)
    tokens = sample(logits, batch["temperature"], batch["top_k"], batch["top_p"],
                    batch["seeds"], batch["steps"])
    return StepOutput(tokens, logits)


def dummy_step(num_tokens: int, num_seqs: int, pages_per_seq: int) -> StepInput:
    """An all-padding batch of one bucket's shape, for warm-up compiles."""
    z = np.zeros
    return StepInput(z(num_tokens, np.int32), z(num_tokens, np.int32), z(num_tokens, np.int32),
                     z(num_seqs + 1, np.int32), z(num_seqs, np.int32), z((num_seqs, pages_per_seq), np.int32),
                     np.int32(0), np.int32(0), z(num_seqs, np.int32), z(num_seqs, np.float32),
                     z(num_seqs, np.int32), np.ones(num_seqs, np.float32), z(num_seqs, np.uint32),
                     z(num_seqs, np.int32))


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
        out, self.kv = self._step(self.params, self.kv, to_device(step, self.device))
        return out

    def warmup(self, token_buckets: list[int], max_num_seqs: int, pages_per_seq: int) -> float:
        """Compile every bucket now, so serving never compiles. Returns the seconds it took."""
        compile_guard.install()
        start = time.perf_counter()
        for i, num_tokens in enumerate(token_buckets, 1):
            t0 = time.perf_counter()
            step = dummy_step(num_tokens, min(num_tokens, max_num_seqs), pages_per_seq)
            jax.block_until_ready(self.execute(step))
            log.info("compiled bucket %d/%d: %d tokens (%.1fs)", i, len(token_buckets), num_tokens,
                     time.perf_counter() - t0)
        # Host-side helpers that touch device arrays must be warmed too.
        np.asarray(self.execute(dummy_step(token_buckets[0], min(token_buckets[0], max_num_seqs),
                                           pages_per_seq)).tokens)
        return time.perf_counter() - start


def cast_params(params: Any, dtype: Any) -> Any:
    """Cast floating params on the host, so no full copy lands on device 0 before staging places them."""
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x).astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x), params)
