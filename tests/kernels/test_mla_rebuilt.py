"""MLA's rebuilt prefill form with its Pallas kernel (`kernels/mla_rebuilt.py`, interpreted on CPU):
equal to the XLA path (`mla_prefill_rebuilt_xla`) and to dense float64 MLA to float32 rounding, on ragged
mixes (decodes, several prefill chunks after cached prefixes of 0, of a block's multiple and not),
v head dim (24) != q/k head dim (48), fp8 latent pages with a scale, blocks smaller and larger than a
chunk; one compile for every mix; the Triton lowering on CPU. Shapes: test_mla_attention.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mla_attention import MIXES, NOPE, RANK, ROPE, SM_SCALE, V_DIM, dense_mla, max_error, mla_batch, rebuilt_out

from jaxcpp.kernels.mla_attention import mla_attention_xla
from jaxcpp.kernels.mla_rebuilt import mla_prefill_rebuilt_attention
from jaxcpp.kernels.ragged_paged_attention import quantize_kv

RAGGED = {  # (new tokens, cached prefix) per sequence, decodes first: prefixes 0, 37 and 250 (blocks: 48, 128)
    "chunks": ([1, 1, 13, 22, 9], [40, 0, 0, 37, 250]),
    "mixed": MIXES["mixed"],
    "one_long_chunk": MIXES["one_long_chunk"],
}
SMALL_BLOCKS = dict(block_q=16, block_kv=32, kv_block_tokens=48)  # 48-position blocks: tiles of 32 padded


def kernel_out(b, pages=None, scale=None, **kw):
    return mla_prefill_rebuilt_attention(b["q_nope"], b["q_rope"], b["pages"] if pages is None else pages,
                                         b["w_uk"], b["w_uv"], b["md"], scale, sm_scale=SM_SCALE, interpret=True,
                                         **kw)


def prefill_rows(md) -> slice:
    return slice(int(md.cu_q_lens[int(md.num_decodes)]), int(md.cu_q_lens[int(md.num_seqs)]))


@pytest.mark.parametrize("mix", list(RAGGED))
def test_kernel_equals_xla_path_and_float64(mix):
    """Prefill rows equal the XLA path and float64; decode and padding rows are exactly 0 (as the XLA
    path leaves them), with the default blocks and with blocks that split chunks and pages."""
    b = mla_batch(*RAGGED[mix], seed=21)
    rows = prefill_rows(b["md"])
    xla, dense = np.asarray(rebuilt_out(b)), dense_mla(b)
    for kw in ({}, SMALL_BLOCKS):
        out = np.asarray(kernel_out(b, **kw))
        assert max_error(out, xla) < 1e-5, kw
        assert max_error(out[rows], dense[rows]) < 1e-5, kw
        assert np.all(out[:rows.start] == 0) and np.all(out[rows.stop:] == 0), kw
        assert out.shape == (*b["q_nope"].shape[:2], V_DIM)


def test_step_with_the_kernel_equals_float64():
    """The whole step (`mla_attention_xla` with the kernel as its rebuilt op): decodes absorbed, prefill
    chunks rebuilt by the kernel, every real row equal to float64."""
    b = mla_batch(*RAGGED["chunks"], seed=23)
    out = mla_attention_xla(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"], sm_scale=SM_SCALE,
                            rebuild_prefill=True,
                            rebuilt=functools.partial(mla_prefill_rebuilt_attention, interpret=True))
    assert max_error(out, dense_mla(b)) < 1e-5


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_latent_pages(fmt):
    """fp8 pages with one scale a layer: the scale is folded into the rebuild, not lost."""
    b = mla_batch(*RAGGED["chunks"], seed=25)
    scale = jnp.float32(0.05)
    pages8 = quantize_kv(b["pages"], scale, fmt)
    dense = dense_mla(b, pages=np.asarray(pages8.astype(jnp.float32)) * 0.05)
    out = np.asarray(kernel_out(b, pages8, scale, **SMALL_BLOCKS))
    rows = prefill_rows(b["md"])
    assert max_error(out[rows], dense[rows]) < 1e-5


def test_bfloat16_dots():
    """bf16 models: K/V and queries enter the kernel's dots in bf16 (fp32 accumulation)."""
    b = mla_batch(*RAGGED["chunks"], seed=27, dtype=jnp.bfloat16)
    assert kernel_out(b).dtype == jnp.bfloat16
    assert max_error(kernel_out(b), rebuilt_out(b)) < 2e-2


def test_new_mix_compiles_nothing():
    fn = jax.jit(functools.partial(mla_prefill_rebuilt_attention, sm_scale=SM_SCALE, interpret=True, **SMALL_BLOCKS))
    for mix in RAGGED:
        b = mla_batch(*RAGGED[mix])
        fn(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"]).block_until_ready()
    assert fn._cache_size() == 1


def test_triton_tiles_are_checked_when_compiled():
    b = mla_batch(*RAGGED["chunks"])
    args = (b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"])
    with pytest.raises(ValueError, match=f"v_head_dim={V_DIM} must be a power of two >= 16"):
        mla_prefill_rebuilt_attention(*args, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="block_kv=8 must be a power of two >= 16"):
        mla_prefill_rebuilt_attention(*args[:4], b["w_uv"][..., :16], b["md"], sm_scale=SM_SCALE, block_kv=8)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernel_lowers_to_triton(platform):
    """The Pallas-to-Triton step on CPU (Triton's own compile needs the device), with dv = 16 != dn + dr
    = 48 and every tile a power of two (dn = 32, dr = 16: the q/k dot is split, so 48 need not be)."""
    assert (NOPE, ROPE, RANK) == (32, 16, 64)
    b = mla_batch(*RAGGED["mixed"], dtype=jnp.bfloat16)
    args = (b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"][..., :16], b["md"])
    fn = jax.jit(functools.partial(mla_prefill_rebuilt_attention, sm_scale=SM_SCALE, block_q=16, block_kv=16))
    assert "xla.gpu.triton" in fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("block_q", [16, 64])
def test_rebuild_runs_once_per_kv_block_whatever_the_query_blocks(monkeypatch, block_q):
    """The property the cost model (W·(L + x), jaxcpp.chunking.mla_cost) rests on: the kv_b_proj rebuild
    runs once per KV block of each prefill sequence, not once per query block. 63 new tokens after 250
    cached, 48-position blocks: ceil(313 / 48) = 7 rebuilds, in 1 query block or 4."""
    from jaxcpp.kernels import mla_rebuilt

    runs = []
    rebuild = mla_rebuilt._rebuild_block

    def counted(*args):
        jax.debug.callback(lambda: runs.append(1))
        return rebuild(*args)

    monkeypatch.setattr(mla_rebuilt, "_rebuild_block", counted)
    mla_rebuilt.mla_prefill_rebuilt_attention.clear_cache()
    b = mla_batch([1, 63], [40, 250])  # the decode rebuilds nothing
    out = kernel_out(b, block_q=block_q, block_kv=16, kv_block_tokens=48)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert len(runs) == 7
