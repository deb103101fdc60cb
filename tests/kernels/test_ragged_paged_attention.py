"""Ragged paged attention: the Pallas kernel against the reference, the reference against dense numpy.

One base class holds every kernel test; `TestKernelInterpret` runs it on CPU with `interpret=True` and
`TestKernelCompiled` compiles it through Triton when a GPU is present (run with JAX_PLATFORMS unset or
`cuda`/`rocm`). Every batch mix of one configuration has the same shapes (T tokens, S sequences, P pages
per sequence), so one compile serves all mixes: that is also what the no-recompile test checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels.backend import select_attention
from jaxcpp.kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_pages,
)

NUM_TOKENS, NUM_SEQS, MAX_KV_LEN, NUM_KV_HEADS = 64, 8, 320, 2
# name -> (new tokens per sequence, cached prefix per sequence); decodes first, as the layout says.
MIXES = {
    "decode": ([1] * 8, [0, 5, 16, 17, 63, 64, 150, 299]),
    "prefill": ([37, 19, 5], [0, 250, 21]),  # chunk lengths no block size divides; empty + long prefix
    "mixed": ([1, 1, 1, 29, 23], [0, 77, 290, 0, 180]),
    "one_long_chunk": ([64], [256]),  # every token real, spans many query and KV blocks
}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_batch(mix: str, *, page_size: int, group: int, head_dim: int, dtype, seed: int = 0):
    return ragged_batch(*MIXES[mix], num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, max_kv_len=MAX_KV_LEN,
                        num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, page_size=page_size, group=group,
                        dtype=dtype, seed=seed)


def dense_attention(q, k_pages, v_pages, md) -> np.ndarray:
    """Naive float64 attention, one sequence at a time, K/V gathered position by position."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    cu, kv_lens, table = (np.asarray(x) for x in (md.cu_q_lens, md.kv_lens, md.page_indices))
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(md.num_seqs)):
        pos = np.arange(kv_lens[s])
        k = np.repeat(k_pages[table[s, pos // page_size], pos % page_size], group, axis=1)  # [kv, H, D]
        v = np.repeat(v_pages[table[s, pos // page_size], pos % page_size], group, axis=1)
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            visible = kv_lens[s] - q_len + i + 1
            scores = np.einsum("hd,nhd->hn", q[cu[s] + i], k[:visible]) / np.sqrt(q.shape[-1])
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[cu[s] + i] = np.einsum("hn,nhd->hd", p / p.sum(axis=-1, keepdims=True), v[:visible])
    return out


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def triton_block_q(group: int) -> int:
    return max(1, 16 // group)  # 16 query rows per program: the smallest tile Triton's dot takes


class KernelTests:
    """Every kernel test, run in interpret mode or compiled depending on INTERPRET."""

    INTERPRET: bool

    def attention(self, q, k_pages, v_pages, md, **kw):
        return ragged_paged_attention(q, k_pages, v_pages, md, interpret=self.INTERPRET, **kw)

    def check_against_reference(self, *, page_size, head_dim, group, dtype, mixes=tuple(MIXES), **kw):
        reference = jax.jit(ragged_paged_attention_reference)
        for mix in mixes:
            q, k_pages, v_pages, md = make_batch(mix, page_size=page_size, group=group, head_dim=head_dim,
                                                 dtype=dtype)
            out = self.attention(q, k_pages, v_pages, md, **kw)
            assert out.shape == q.shape and out.dtype == q.dtype
            err = max_error(out, reference(q, k_pages, v_pages, md))
            assert err <= TOLERANCE[dtype], f"{mix}: max error {err}"

    # bf16: the slowest dozen (about 3 s each interpreted), marked slow; still part of `make test`.
    @pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)],
                             ids=["fp32", "bf16"])
    @pytest.mark.parametrize("group", [1, 4, 8])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("page_size", [16, 64])
    def test_matches_reference(self, page_size, head_dim, group, dtype):
        self.check_against_reference(page_size=page_size, head_dim=head_dim, group=group, dtype=dtype,
                                     block_q=triton_block_q(group), pages_per_block=32 // min(page_size, 32))

    @pytest.mark.parametrize("page_size", [16, 64])
    def test_default_block_sizes(self, page_size):
        # Defaults give one 64-token query block touching every sequence of the batch.
        self.check_against_reference(page_size=page_size, head_dim=128, group=4, dtype=jnp.float32)

    def test_new_mix_compiles_nothing(self):
        shape = dict(page_size=16, group=4, head_dim=64, dtype=jnp.float32)
        kw = dict(block_q=4, pages_per_block=2)
        self.attention(*make_batch("decode", **shape), **kw).block_until_ready()
        compiled = ragged_paged_attention._cache_size()
        for mix in ("prefill", "mixed", "one_long_chunk"):
            self.attention(*make_batch(mix, seed=1, **shape), **kw).block_until_ready()
        assert ragged_paged_attention._cache_size() == compiled

    def test_selected_backend_under_jit(self):
        attention = select_attention("pallas", interpret=self.INTERPRET)
        step = jax.jit(lambda q, k, v, md: attention(q, k, v, md))
        shape = dict(page_size=16, group=4, head_dim=64, dtype=jnp.float32)
        for mix in MIXES:
            q, k_pages, v_pages, md = make_batch(mix, **shape)
            ref = ragged_paged_attention_reference(q, k_pages, v_pages, md)
            assert max_error(step(q, k_pages, v_pages, md), ref) <= 1e-5
        assert step._cache_size() == 1


class TestKernelInterpret(KernelTests):
    INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled Triton lowering)")
class TestKernelCompiled(KernelTests):
    INTERPRET = False


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("page_size", "group", "head_dim"), [(16, 4, 64), (64, 1, 128), (16, 8, 128)])
def test_reference_matches_dense_numpy(mix, page_size, group, head_dim):
    q, k_pages, v_pages, md = make_batch(mix, page_size=page_size, group=group, head_dim=head_dim,
                                         dtype=jnp.float32)
    expected = dense_attention(q, k_pages, v_pages, md)
    for kv_block_tokens in (32, 128):  # several loop trips, and a block wider than a page
        out = ragged_paged_attention_reference(q, k_pages, v_pages, md, kv_block_tokens=kv_block_tokens)
        assert max_error(out, expected) <= 1e-5


def test_write_kv_pages_puts_tokens_in_their_slots():
    q, k_pages, v_pages, md = make_batch("mixed", page_size=16, group=1, head_dim=64, dtype=jnp.float32)
    new = jnp.asarray(np.random.default_rng(3).standard_normal((2, *q.shape[:1], *k_pages.shape[2:])))
    k2, v2 = write_kv_pages(k_pages, v_pages, new[0], new[1], md.slot_mapping)
    flat_k, flat_v = k2.reshape(-1, *k2.shape[2:]), v2.reshape(-1, *v2.shape[2:])
    num_real = int(md.cu_q_lens[md.num_seqs])
    slots = np.asarray(md.slot_mapping[:num_real])
    np.testing.assert_array_equal(flat_k[slots], new[0, :num_real])
    np.testing.assert_array_equal(flat_v[slots], new[1, :num_real])
    untouched = np.ones(flat_k.shape[0], bool)
    untouched[slots] = False
    untouched[: k2.shape[1]] = False  # page 0 takes the padding tokens
    np.testing.assert_array_equal(flat_k[untouched], k_pages.reshape(flat_k.shape)[untouched])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v, md: (q[0], k, v, md), "q.shape"),
        (lambda q, k, v, md: (q, k, v[..., :32], md), "v_pages.shape"),
        (lambda q, k, v, md: (q[:, :3], k, v, md), "num_kv_heads"),
        (lambda q, k, v, md: (q, k, v, md._replace(kv_lens=md.kv_lens[:-1])), "md.cu_q_lens"),
        (lambda q, k, v, md: (q, k, v, md._replace(slot_mapping=md.slot_mapping[:-1])), "md.slot_mapping"),
        (lambda q, k, v, md: (q, k, v, md._replace(page_indices=md.page_indices[0])), "md.page_indices"),
    ],
)
def test_bad_inputs_name_the_shapes(change, message):
    batch = make_batch("mixed", page_size=16, group=2, head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ragged_paged_attention(*change(*batch), interpret=True)


def test_triton_tile_constraints_checked_before_lowering():
    batch = make_batch("mixed", page_size=16, group=4, head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_q \\* group=12 must be a power of two"):
        ragged_paged_attention(*batch, block_q=3, interpret=False)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_through_triton_without_a_gpu(platform, dtype):
    """Cross-lowering runs the Pallas->Triton IR step on CPU: tile shapes and primitives Triton lacks fail
    here. (Triton's own compile to PTX/HSACO still needs the device.)"""
    batch = make_batch("mixed", page_size=16, group=4, head_dim=128, dtype=dtype)
    for kw in ({}, dict(block_q=4, pages_per_block=2, num_warps=4, num_stages=1)):
        lowered = jax.jit(functools.partial(ragged_paged_attention, interpret=False, **kw)).trace(*batch)
        assert "xla.gpu.triton" in lowered.lower(lowering_platforms=(platform,)).as_text()
