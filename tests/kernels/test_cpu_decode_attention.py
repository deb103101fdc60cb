"""The C++ decode attention (`cpu_decode_attention`): the XLA path's decode rows on CPU, pages read in place.

It must give the reference's result to float32 rounding for every head size (64 and 128 have loops of
their own), every GQA group and page size, and a row's result must not depend on the rows beside it
(the engine's exactness tests compare a sequence decoded in different batches).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels import cpu_decode_attention
from jaxcpp.kernels.ragged_paged_attention import ragged_paged_attention_reference, ragged_paged_attention_xla

DECODES = ([1] * 10, [0, 5, 15, 16, 63, 64, 150, 299, 700, 1])  # one row per decode; a context of 1 too
needs_kernel = pytest.mark.skipif(not cpu_decode_attention.available(), reason="no C++ compiler here")


def decode_batch(*, head_dim: int, group: int, page_size: int, seed: int = 0, q_lens=DECODES[0],
                 prefixes=DECODES[1]):
    return ragged_batch(q_lens, prefixes, num_tokens=16, num_seqs=16, max_kv_len=768, num_kv_heads=2,
                        head_dim=head_dim, page_size=page_size, group=group, dtype=jnp.float32, seed=seed)


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@needs_kernel
def test_auto_takes_the_kernel_on_cpu():
    q, k_pages, v_pages, md = decode_batch(head_dim=64, group=2, page_size=16)
    hlo = jax.jit(ragged_paged_attention_xla).lower(q, k_pages, v_pages, md).as_text()
    assert cpu_decode_attention.TARGET in hlo
    forced_xla = jax.jit(functools.partial(ragged_paged_attention_xla, decode_kernel="xla"))
    assert cpu_decode_attention.TARGET not in forced_xla.lower(q, k_pages, v_pages, md).as_text()


@needs_kernel
@pytest.mark.parametrize("head_dim,group,page_size", [(64, 2, 16), (128, 4, 16), (64, 1, 64), (80, 3, 16)])
def test_matches_the_reference(head_dim, group, page_size):
    batch = decode_batch(head_dim=head_dim, group=group, page_size=page_size)
    want = jax.jit(ragged_paged_attention_reference)(*batch)
    for kernel in ("cpp", "xla"):
        got = jax.jit(functools.partial(ragged_paged_attention_xla, decode_kernel=kernel))(*batch)
        assert max_error(got, want) <= 1e-5, kernel
        assert not np.asarray(got[len(DECODES[0]):]).any(), f"{kernel}: padding rows must be 0"


@needs_kernel
def test_a_row_does_not_depend_on_its_neighbours():
    """Row 3 alone and among nine others: bitwise the same output."""
    q, k_pages, v_pages, md = decode_batch(head_dim=64, group=2, page_size=16)
    f = jax.jit(functools.partial(ragged_paged_attention_xla, decode_kernel="cpp"))
    together = f(q, k_pages, v_pages, md)
    row = 3
    alone = md._replace(
        cu_q_lens=jnp.minimum(jnp.arange(md.cu_q_lens.shape[0], dtype=jnp.int32), 1),
        kv_lens=jnp.zeros_like(md.kv_lens).at[0].set(md.kv_lens[row]),
        page_indices=jnp.zeros_like(md.page_indices).at[0].set(md.page_indices[row]),
        num_seqs=jnp.int32(1), num_decodes=jnp.int32(1))
    out = f(jnp.zeros_like(q).at[0].set(q[row]), k_pages, v_pages, alone)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(together[row]))


def test_an_unknown_decode_kernel_is_named():
    with pytest.raises(ValueError, match="decode_kernel"):
        ragged_paged_attention_xla(*decode_batch(head_dim=64, group=2, page_size=16), decode_kernel="fast")


def test_a_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """No working compiler: `available()` is False and says why; the XLA ops serve the decodes."""
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setenv(cpu_decode_attention.CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpu_decode_attention.available.__wrapped__() is False
    assert "falls back" in caplog.text or "runs as XLA ops" in caplog.text
    assert not list(tmp_path.iterdir())  # no half-built library left behind


def test_the_switch_turns_the_kernel_off(monkeypatch):
    """JAXCPP_CPU_DECODE_KERNEL=0: never built or used, the XLA ops serve the decodes."""
    monkeypatch.setenv(cpu_decode_attention.SWITCH_ENV, "0")
    assert cpu_decode_attention.available.__wrapped__() is False
