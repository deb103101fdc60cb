"""The device sampler: a row's token never depends on the rows beside it or on which path ran.

On CPU a batch runs only what its rows ask for (`lax.cond`); on other backends it runs every part
(a device conditional would sync the host). Both must give every row the same token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcpp.runtime import sampler

VOCAB = 256


def batch(temperature, top_k, top_p):  # type: ignore[no-untyped-def]
    n = len(temperature)
    rng = np.random.default_rng(0)
    # Peaked rows: the rounded cumulative softmax mass reaches 1 before their last tokens.
    logits = rng.normal(0, 10, (n, VOCAB))
    return (jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
            jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
            jnp.arange(n, dtype=jnp.uint32) + 7, jnp.full(n, 3, jnp.int32))


def test_top_p_one_and_top_k_zero_mask_nothing():
    logits, *_ = batch([1.0] * 4, [0] * 4, [1.0] * 4)
    probs = jax.nn.softmax(-jnp.sort(-logits, axis=-1), axis=-1)
    assert float(jnp.max(jnp.cumsum(probs, axis=-1) - probs)) >= 1.0  # the case top_p 1 must not cut
    assert bool(jnp.all(sampler._mask_top_p(logits, jnp.ones(4)) == logits))
    assert bool(jnp.all(sampler._mask_top_k(logits, jnp.zeros(4, jnp.int32)) == logits))


ROWS = dict(temperature=[0.0, 0.8, 1.0, 0.7], top_k=[0, 0, 20, 0], top_p=[1.0, 1.0, 1.0, 0.9])


@pytest.mark.parametrize("rows", [[0], [1], [0, 1], [0, 1, 2, 3], [1, 3]])
def test_each_row_gets_the_same_token_alone_in_any_batch_and_on_either_path(rows, monkeypatch):
    full = batch(**ROWS)
    alone = [int(jax.jit(sampler.sample)(*(x[i:i + 1] for x in full))[0]) for i in range(4)]
    pick = jnp.asarray(rows)
    together = jax.jit(sampler.sample)(*(x[pick] for x in full))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # traced anew: the path without conditionals
    unconditional = jax.jit(sampler.sample)(*(x[pick] for x in full))
    assert [int(t) for t in together] == [alone[i] for i in rows] == [int(t) for t in unconditional]
