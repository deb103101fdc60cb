"""`--mla-prefill auto`: time both forms of one MLA layer's prefill attention on this stage's device at
start-up and fit the weight the per-step rule gives the rebuild (`jaxcpp.chunking.mla_cost`).

The FLOP rule (weight 1) assumes both forms run at the device's matmul peak. They do not everywhere:
on XLA:CPU the rebuilt form's (KV block, query block) pairs of small matmuls run slower per FLOP than
the absorbed form's one wide MQA matmul, and absorbed was faster at every chunk size the FLOP rule
rebuilds (docs/benchmarks.md, "## MLA"). So the stage times one layer's attention (the model's head
layout, random latent pages; no weights, no other layer) both ways, each form by the op the stage runs
for its `--attention-backend` (under `pallas` the two Pallas kernels; measured apart per backend), for
a chunk of budget/4, budget/2 and budget tokens after a prefix of one budget (median of 3 after a
warm-up), and takes the weight that sorts those points as measured (`fit_rebuild_weight`). The weight
is a constant of the stage's programs, fixed before they compile: one program per bucket, whatever was
measured.

    weight = rebuild_weight(mode, config, device, budget, page_size, backend)   # 1.0, inf, 0.0, or measured
"""

from __future__ import annotations

import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcpp.chunking.mla_cost import FormTiming, MlaShape, fit_rebuild_weight, fixed_rebuild_weight, prefer_rebuild
from jaxcpp.kernels.backend import resolve_backend, select_mla_absorbed, select_mla_rebuilt
from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.kernels.mla_attention import (
    AbsorbedFn,
    RebuiltFn,
    mla_absorbed_xla,
    mla_attention_xla,
    mla_prefill_rebuilt_xla,
)
from jaxcpp.models.config import ModelConfig

log = logging.getLogger(__name__)
REPEATS = 3
_MEASURED: dict[tuple, tuple[float, str]] = {}  # stages of one process on one platform measure once
CHUNK_SHARES = (4, 2, 1)  # chunks of budget / share tokens, after a prefix of one budget


def _one_sequence(prefix_len: int, chunk: int, page_size: int) -> AttentionMetadata:
    """One prefill sequence: `chunk` new tokens after `prefix_len` cached ones, pages 1, 2, ... in order."""
    kv_len = prefix_len + chunk
    num_pages = -(-kv_len // page_size)
    slots = np.arange(prefix_len, kv_len) + page_size  # page 0 is the padding page
    return AttentionMetadata(
        positions=jnp.arange(prefix_len, kv_len, dtype=jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        cu_q_lens=jnp.asarray([0, chunk], jnp.int32), kv_lens=jnp.asarray([kv_len], jnp.int32),
        page_indices=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None], num_seqs=jnp.int32(1),
        num_decodes=jnp.int32(0))


def time_forms(config: ModelConfig, device: jax.Device, prefix_len: int, chunk: int, page_size: int,
               dtype: jnp.dtype, absorbed: AbsorbedFn = mla_absorbed_xla,
               rebuilt: RebuiltFn = mla_prefill_rebuilt_xla) -> FormTiming:
    """Median seconds of one layer's MLA attention for the chunk, absorbed and rebuilt (by `absorbed` and
    `rebuilt`, the stage's own ops), on `device`."""
    c = config
    rng = np.random.default_rng(0)
    pages_needed = 1 + -(-(prefix_len + chunk) // page_size)

    def rand(*shape: int) -> jax.Array:
        return jax.device_put(jnp.asarray(rng.standard_normal(shape) * 0.1, dtype), device)

    heads = c.num_attention_heads
    args = (rand(chunk, heads, c.qk_nope_head_dim), rand(chunk, heads, c.qk_rope_head_dim),
            rand(pages_needed, page_size, c.kv_lora_rank + c.qk_rope_head_dim),
            rand(c.kv_lora_rank, heads, c.qk_nope_head_dim), rand(c.kv_lora_rank, heads, c.v_head_dim),
            jax.device_put(_one_sequence(prefix_len, chunk, page_size), device))
    seconds = []
    for rebuild in (False, True):
        fn = jax.jit(lambda *a, rebuild=rebuild: mla_attention_xla(*a, sm_scale=c.qk_head_dim ** -0.5,
                                                                   rebuild_prefill=rebuild, absorbed=absorbed,
                                                                   rebuilt=rebuilt))
        fn(*args).block_until_ready()  # compile and warm up
        runs = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            runs.append(time.perf_counter() - start)
        seconds.append(float(np.median(runs)))
    return FormTiming(prefix_len, chunk, *seconds)


def rebuild_weight(mode: str, config: ModelConfig, device: jax.Device, budget: int, page_size: int,
                   backend: str = "xla") -> float:
    """The weight `--mla-prefill mode` gives the rebuild: fixed (flops 1, absorbed inf, rebuilt 0), or
    for auto measured on `device` with the absorbed and rebuilt ops `--attention-backend` gives the stages
    (see the module docstring). Logs what it chose and why."""
    fixed = fixed_rebuild_weight(mode)
    shape = MlaShape.of(config)
    if fixed is not None:
        weight, how = fixed, f"--mla-prefill {mode}"
    else:
        key = (shape, config.dtype, device.platform, budget, page_size, resolve_backend(backend))
        if key not in _MEASURED:
            _MEASURED[key] = _measure(config, shape, device, budget, page_size, select_mla_absorbed(backend),
                                      select_mla_rebuilt(backend))
        weight, how = _MEASURED[key]
    chunks = [budget // s for s in CHUNK_SHARES]
    rebuilds = [x for x in chunks if prefer_rebuild(shape, budget, x, weight)]
    log.info("MLA prefill: rebuild weight %s (%s); after a %d-token prefix, chunks of %s tokens rebuild",
             f"{weight:.3g}" if math.isfinite(weight) else "inf", how, budget,
             ", ".join(map(str, rebuilds)) if rebuilds else "none of " + "/".join(map(str, chunks)))
    return weight


def _measure(config: ModelConfig, shape: MlaShape, device: jax.Device, budget: int, page_size: int,
             absorbed: AbsorbedFn, rebuilt: RebuiltFn) -> tuple[float, str]:
    start = time.perf_counter()
    timings = [time_forms(config, device, budget, max(budget // share, 1), page_size, jnp.dtype(config.dtype),
                          absorbed, rebuilt) for share in CHUNK_SHARES]
    points = ", ".join(f"{t.chunk} after {t.prefix_len}: absorbed {t.absorbed_s * 1e3:.1f} ms, rebuilt "
                       f"{t.rebuilt_s * 1e3:.1f} ms" for t in timings)
    how = f"measured on {device.platform} in {time.perf_counter() - start:.1f}s ({points})"
    return fit_rebuild_weight(shape, timings), how
