"""The C++ attention (`cpu_attention`): the XLA path's decode rows and prefill chunks on CPU, pages read in place.

Each kernel must give the reference's result to float32 rounding for every head size (32, 64 and 128 have
loops of their own in the decode kernel; the prefill kernel pads other sizes), every GQA group and page
size, and a row's result must not depend on the rows beside it nor, for a prompt, on how it was cut into
chunks (the engine's exactness tests compare a sequence decoded in different batches and prefilled in
different chunks).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels import cpu_attention
from jaxcpp.kernels.ragged_paged_attention import ragged_paged_attention_reference, ragged_paged_attention_xla

DECODES = ([1] * 10, [0, 5, 15, 16, 63, 64, 150, 299, 700, 1])  # one row per decode; a context of 1 too
needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler here")


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
    assert cpu_attention.DECODE_TARGET in hlo
    forced_xla = jax.jit(functools.partial(ragged_paged_attention_xla, decode_kernel="xla"))
    assert cpu_attention.DECODE_TARGET not in forced_xla.lower(q, k_pages, v_pages, md).as_text()


@needs_kernel
@pytest.mark.parametrize("head_dim,group,page_size", [(32, 2, 16), (64, 2, 16), (128, 4, 16), (64, 1, 64),
                                                      (80, 3, 16)])
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


# Decodes first, then chunks: a whole prompt, chunks after cached prefixes (one crossing a KV block of 128
# positions, one of two tokens after a long prefix), and a chunk longer than a task's query block.
PREFILLS = ([1, 1, 37, 200, 130, 2, 300], [5, 300, 0, 250, 37, 700, 0])


def prefill_batch(*, head_dim: int, group: int, page_size: int, seed: int = 0, q_lens=PREFILLS[0],
                  prefixes=PREFILLS[1]):
    return ragged_batch(q_lens, prefixes, num_tokens=704, num_seqs=8, max_kv_len=768, num_kv_heads=2,
                        head_dim=head_dim, page_size=page_size, group=group, dtype=jnp.float32, seed=seed)


def prefill_kernel(kernel: str):
    return jax.jit(functools.partial(ragged_paged_attention_xla, prefill_kernel=kernel))


@needs_kernel
def test_auto_takes_the_prefill_kernel_on_cpu():
    batch = prefill_batch(head_dim=64, group=2, page_size=16)
    assert cpu_attention.PREFILL_TARGET in jax.jit(ragged_paged_attention_xla).lower(*batch).as_text()
    assert cpu_attention.PREFILL_TARGET not in prefill_kernel("xla").lower(*batch).as_text()


@needs_kernel
@pytest.mark.parametrize("head_dim,group,page_size", [(32, 2, 16), (64, 2, 16), (128, 4, 16), (64, 1, 64),
                                                      (80, 3, 16), (16, 8, 16), (16, 72, 16)])
def test_prefill_matches_the_reference(head_dim, group, page_size):
    batch = prefill_batch(head_dim=head_dim, group=group, page_size=page_size)
    want = jax.jit(ragged_paged_attention_reference)(*batch)
    for kernel in ("cpp", "xla"):
        got = prefill_kernel(kernel)(*batch)
        assert max_error(got, want) <= 1e-5, kernel
        assert not np.asarray(got[sum(PREFILLS[0]):]).any(), f"{kernel}: padding tokens must be 0"


@needs_kernel
def test_a_prompt_does_not_depend_on_its_chunks_or_neighbours():
    """A 300-token prompt in one chunk beside other sequences, and in chunks of 100 / 7 / 193 alone:
    bitwise the same output for every token (the kernel's KV blocks are aligned to absolute positions,
    and a position a row does not see adds an exact 0)."""
    q, k_pages, v_pages, md = prefill_batch(head_dim=64, group=2, page_size=16)
    f = prefill_kernel("cpp")
    together = np.asarray(f(q, k_pages, v_pages, md))
    s = len(PREFILLS[0]) - 1  # the whole prompt, last in the batch
    start, pages = int(md.cu_q_lens[s]), md.page_indices[s]
    pieces = []
    for offset, length in ((0, 100), (100, 7), (107, 193)):
        alone = md._replace(
            cu_q_lens=jnp.minimum(jnp.arange(md.cu_q_lens.shape[0], dtype=jnp.int32), 1) * length,
            kv_lens=jnp.zeros_like(md.kv_lens).at[0].set(offset + length),
            page_indices=jnp.zeros_like(md.page_indices).at[0].set(pages),
            num_seqs=jnp.int32(1), num_decodes=jnp.int32(0))
        chunk_q = jnp.zeros_like(q).at[:length].set(q[start + offset:start + offset + length])
        pieces.append(np.asarray(f(chunk_q, k_pages, v_pages, alone))[:length])
    np.testing.assert_array_equal(np.concatenate(pieces), together[start:start + 300])


@needs_kernel
def test_prefill_lengths_past_the_page_table_are_cut_not_read():
    """A kv_len beyond the page table (a corrupt step) must not read past the pages: its rows come out
    finite or 0, and the other sequences are untouched."""
    q, k_pages, v_pages, md = prefill_batch(head_dim=32, group=2, page_size=16)
    good = prefill_kernel("cpp")(q, k_pages, v_pages, md)
    bad = md._replace(kv_lens=md.kv_lens.at[3].set(100_000))
    out = np.asarray(prefill_kernel("cpp")(q, k_pages, v_pages, bad))
    assert np.isfinite(out).all()
    other = slice(int(md.cu_q_lens[4]), int(md.cu_q_lens[len(PREFILLS[0])]))
    np.testing.assert_array_equal(out[other], np.asarray(good)[other])


def test_an_unknown_prefill_kernel_is_named():
    with pytest.raises(ValueError, match="prefill_kernel"):
        ragged_paged_attention_xla(*prefill_batch(head_dim=64, group=2, page_size=16), prefill_kernel="fast")


def test_a_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """No working compiler: `available()` is False and says why; the XLA ops serve the decodes."""
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpu_attention.available.__wrapped__() is False
    assert "falls back" in caplog.text or "runs as XLA ops" in caplog.text
    assert not list(tmp_path.iterdir())  # no half-built library left behind


def test_the_switch_turns_the_kernel_off(monkeypatch):
    """JAXCPP_CPU_ATTENTION_KERNEL=0: never built or used, the XLA ops serve every token."""
    monkeypatch.setenv(cpu_attention.SWITCH_ENV, "0")
    assert cpu_attention.available.__wrapped__() is False
