"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Each row draws with the key fold_in(PRNGKey(seed), step), where `step` is how many tokens the request
has generated: the same seed gives the same tokens whatever batch the request shares, and a request
preempted and recomputed draws the same tokens again.

On the CPU backend the sorts of top-k / top-p and the per-row threefry draw cost several times the
rest of a small model's decode step, so a batch runs only what its rows ask for (`lax.cond`, data,
not shape: still one program): all-greedy batches take the argmax alone, and the sorts run only when
some sampling row sets top-k or top-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sample(
    logits: jax.Array,       # [S, V] float32
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,        # [S] int32, 0 = off
    top_p: jax.Array,        # [S] float32 in (0, 1]
    seeds: jax.Array,        # [S] uint32
    steps: jax.Array,        # [S] int32
) -> jax.Array:              # [S] int32
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperature > 0

    def draw(_: None) -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        truncates = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0)))
        masked = lax.cond(truncates, lambda x: _mask_top_p(_mask_top_k(x, top_k), top_p), lambda x: x, scaled)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    return lax.cond(jnp.any(sampling), draw, lambda _: greedy, None)


def _mask_top_k(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    descending = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)
    return jnp.where(logits < kth, -jnp.inf, logits)


def _mask_top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    keep = mass_before < top_p[:, None]
    threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)
