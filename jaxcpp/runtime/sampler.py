"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Each row draws with the key fold_in(PRNGKey(seed), step), where `step` is how many tokens the request
has generated: the same seed gives the same tokens whatever batch the request shares, and a request
preempted and recomputed draws the same tokens again.

On the CPU backend the sorts of top-k / top-p and the per-row threefry draw cost several times the
rest of a small model's decode step, so there a batch runs only what its rows ask for (`lax.cond`,
data, not shape: still one program): all-greedy batches take the argmax alone, and the sorts run only
when some sampling row sets top-k or top-p. Elsewhere every batch runs all of it: a GPU conditional
copies its predicate to the host and waits for it, a host sync per step that would undo async
scheduling. Either way a row's token is the same: the masks are exact no-ops on rows that do not ask
for them (top_k 0, top_p 1), so a row never depends on the rows beside it.
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

    def draw(truncate: bool) -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        masked = _mask_top_p(_mask_top_k(scaled, top_k), top_p) if truncate else scaled
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    if jax.default_backend() != "cpu":  # a device conditional would sync the host (module docstring)
        return draw(truncate=True)
    truncates = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0)))

    def draw_some() -> jax.Array:
        return lax.cond(truncates, lambda: draw(True), lambda: draw(False))

    return lax.cond(jnp.any(sampling), draw_some, lambda: greedy)


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
    # top_p 1 keeps every token (the rounded cumulative mass may pass 1 before the tail).
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)
