"""MLA attention over latent pages: absorbed == rebuilt == dense float64, kernel == reference.

Shapes are DeepSeek's layout scaled down: H = 8 heads, kv_lora_rank r = 64, qk_rope_head_dim dr = 16,
qk_nope_head_dim dn = 32, v_head_dim dv = 24 (dv differs from the q/k head dim dn + dr = 48, as in
DeepSeek-V3: 128 vs 192). `INTERPRET` picks the kernel's mode as in test_ragged_paged_attention.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batch import ragged_batch

from jaxcpp.kernels.mla_attention import (
    absorb_queries,
    mla_absorbed_attention,
    mla_absorbed_reference,
    mla_absorbed_xla,
    mla_attention_auto,
    mla_attention_xla,
    mla_prefill_rebuilt_xla,
    project_values,
    rebuild_is_cheaper,
    split_kv_b,
    write_latent_pages,
)
from jaxcpp.kernels.ragged_paged_attention import quantize_kv

HEADS, RANK, ROPE, NOPE, V_DIM = 8, 64, 16, 32, 24
SM_SCALE = (NOPE + ROPE) ** -0.5 * 1.3  # a YaRN-like mscale² on top of DeepSeek's qk_head_dim ** -0.5
NUM_TOKENS, NUM_SEQS, MAX_KV_LEN, PAGE = 64, 8, 320, 16
MIXES = {  # (new tokens per sequence, cached prefix per sequence), decodes first
    "decode": ([1] * 8, [0, 5, 16, 17, 63, 64, 150, 299]),
    "prefill": ([37, 19, 5], [0, 250, 21]),
    "mixed": ([1, 1, 1, 29, 23], [0, 77, 290, 0, 180]),
    "one_long_chunk": ([64], [256]),
}


def mla_batch(q_lens, prefixes, *, seed=0, dtype=jnp.float32):
    """Queries (nope, rope, and the absorbed latent ones), kv_b weights, latent pages, metadata."""
    _, _, _, md = ragged_batch(q_lens, prefixes, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                               max_kv_len=MAX_KV_LEN, num_kv_heads=1, head_dim=1, page_size=PAGE, group=1,
                               dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    num_pages = 1 + NUM_SEQS * (MAX_KV_LEN // PAGE)
    kv_b = rng.standard_normal((HEADS * (NOPE + V_DIM), RANK)) * RANK**-0.5  # transformers' layout
    w_uk, w_uv = split_kv_b(jnp.asarray(kv_b, dtype), HEADS, NOPE, V_DIM)
    q_nope = jnp.asarray(rng.standard_normal((NUM_TOKENS, HEADS, NOPE)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((NUM_TOKENS, HEADS, ROPE)), dtype)
    pages = jnp.asarray(rng.standard_normal((num_pages, PAGE, RANK + ROPE)), dtype)
    return dict(q_nope=q_nope, q_rope=q_rope, w_uk=w_uk, w_uv=w_uv, pages=pages, md=md)


def dense_mla(b, pages=None) -> np.ndarray:
    """float64 MLA as transformers computes it: every head's K/V decompressed position by position."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    pages = f64(b["pages"] if pages is None else pages)
    q = np.concatenate([f64(b["q_nope"]), f64(b["q_rope"])], axis=-1)
    w_uk, w_uv, md = f64(b["w_uk"]), f64(b["w_uv"]), b["md"]
    cu, kv_lens, table = (np.asarray(x) for x in (md.cu_q_lens, md.kv_lens, md.page_indices))
    out = np.zeros((q.shape[0], HEADS, V_DIM))
    for s in range(int(md.num_seqs)):
        pos = np.arange(kv_lens[s])
        rows = pages[table[s, pos // PAGE], pos % PAGE]
        c, k_rope = rows[:, :RANK], rows[:, RANK:]
        k = np.concatenate([np.einsum("nr,rhd->nhd", c, w_uk),
                            np.repeat(k_rope[:, None], HEADS, axis=1)], axis=-1)
        v = np.einsum("nr,rhd->nhd", c, w_uv)
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            visible = kv_lens[s] - q_len + i + 1
            scores = np.einsum("hd,nhd->hn", q[cu[s] + i], k[:visible]) * SM_SCALE
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[cu[s] + i] = np.einsum("hn,nhd->hd", p / p.sum(axis=-1, keepdims=True), v[:visible])
    return out


def absorbed_out(b, attention=mla_absorbed_xla, **kw):
    latent = attention(absorb_queries(b["q_nope"], b["w_uk"]), b["q_rope"], b["pages"], b["md"],
                       sm_scale=SM_SCALE, **kw)
    return project_values(latent, b["w_uv"])


def rebuilt_out(b, **kw):
    return mla_prefill_rebuilt_xla(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"],
                                   sm_scale=SM_SCALE, **kw)


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("prefix", [0, 1, 37, 128, 255])
def test_absorbed_equals_rebuilt_at_prefix_lengths(prefix):
    """One prefill chunk of 64 tokens after `prefix` cached ones: both forms match float64 and each other
    to float32 rounding (outputs are O(1): 1e-5 is a few hundred float32 ulps of accumulated sums)."""
    b = mla_batch([64], [prefix], seed=prefix)
    dense = dense_mla(b)
    absorbed, rebuilt = absorbed_out(b), rebuilt_out(b)
    assert max_error(absorbed, dense) < 1e-5
    assert max_error(rebuilt, dense) < 1e-5
    assert max_error(absorbed, rebuilt) < 1e-5


@pytest.mark.parametrize("mix", list(MIXES))
def test_step_forms_on_ragged_mixes(mix):
    """Mixed decode/prefill batches: decodes absorbed, prefill absorbed or rebuilt, equal to float64;
    padding tokens exactly 0; the rebuilt op alone gives decode tokens 0."""
    b = mla_batch(*MIXES[mix], seed=3)
    dense = dense_mla(b)
    run = functools.partial(mla_attention_xla, b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"],
                            b["md"], sm_scale=SM_SCALE)
    for rebuild in (False, True):
        out = run(rebuild_prefill=rebuild)
        assert max_error(out, dense) < 1e-5, rebuild
        real = int(b["md"].cu_q_lens[int(b["md"].num_seqs)])
        assert np.all(np.asarray(out)[real:] == 0)
    decodes = int(b["md"].num_decodes)
    assert np.all(np.asarray(rebuilt_out(b))[:decodes] == 0)


def _flops():
    from jaxcpp.chunking.mla_cost import MlaShape

    shape = MlaShape(HEADS, RANK, NOPE, ROPE, V_DIM)
    return shape, (shape.kv_b_flops, shape.pair_flops("absorbed"), shape.pair_flops("rebuilt"))


@pytest.mark.parametrize(("chunk", "prefix"), [(61, 0), (2, 250), (17, 250), (61, 256), (37, 21)])
def test_per_step_choice_is_the_flop_rule(chunk, prefix):
    """One prefill sequence (after 3 decodes, which never count): the device-side choice equals
    `jaxcpp.chunking.mla_cost.prefer_rebuild`, and the step's output equals float64 either way."""
    from jaxcpp.chunking.mla_cost import prefer_rebuild

    shape, flops = _flops()
    b = mla_batch([1, 1, 1, chunk], [40, 0, 299, prefix], seed=chunk)
    assert bool(rebuild_is_cheaper(b["md"], *flops)) == prefer_rebuild(shape, prefix, chunk)
    out = mla_attention_auto(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"],
                             sm_scale=SM_SCALE, flops=flops)
    assert max_error(out, dense_mla(b)) < 1e-5
    decodes_only = mla_batch([1, 1], [3, 200])["md"]
    assert not bool(rebuild_is_cheaper(decodes_only, *flops))  # decodes always attend absorbed


@pytest.mark.parametrize("weight", [0.0, 0.5, 2.0, math.inf])
def test_per_step_choice_is_the_host_rule_for_every_rebuild_weight(weight):
    """--mla-prefill: the device's choice equals `prefer_rebuild` under the configured weight (rebuilt 0,
    a measured 0.5 or 2, absorbed inf) at every shape, decodes-only steps never rebuild, and a fixed
    form (0, inf) computes the same output as the float64 reference."""
    from jaxcpp.chunking.mla_cost import prefer_rebuild

    shape, flops = _flops()
    for chunk, prefix in [(61, 0), (2, 250), (17, 250), (61, 256), (37, 21)]:
        b = mla_batch([1, 1, 1, chunk], [40, 0, 299, prefix], seed=chunk)
        assert bool(rebuild_is_cheaper(b["md"], *flops, weight)) == prefer_rebuild(shape, prefix, chunk, weight)
    assert not bool(rebuild_is_cheaper(mla_batch([1, 1], [3, 200])["md"], *flops, weight))
    if weight in (0.0, math.inf):
        out = mla_attention_auto(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"],
                                 sm_scale=SM_SCALE, flops=flops, rebuild_weight=weight)
        assert max_error(out, dense_mla(b)) < 1e-5


def test_rebuilt_small_blocks_and_one_compile():
    """Query and KV blocks smaller than a chunk and a page: the same result; a new mix compiles nothing."""
    rebuilt = jax.jit(functools.partial(mla_prefill_rebuilt_xla, sm_scale=SM_SCALE, block_q=16, kv_block_tokens=8))
    for mix in ("prefill", "mixed", "one_long_chunk"):
        b = mla_batch(*MIXES[mix], seed=5)
        out = rebuilt(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"], b["w_uv"], b["md"])
        prefill = np.asarray(b["md"].cu_q_lens)[int(b["md"].num_decodes)]
        assert max_error(np.asarray(out)[prefill:], dense_mla(b)[prefill:]) < 1e-5
    assert rebuilt._cache_size() == 1


def test_absorbed_xla_matches_reference():
    for mix in MIXES:
        b = mla_batch(*MIXES[mix], seed=7)
        q_lat = absorb_queries(b["q_nope"], b["w_uk"])
        args = (q_lat, b["q_rope"], b["pages"], b["md"])
        assert max_error(mla_absorbed_xla(*args, sm_scale=SM_SCALE),
                         mla_absorbed_reference(*args, sm_scale=SM_SCALE)) < 1e-5, mix


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_latent_pages(fmt):
    """fp8 pages with one scale a layer: every path equals float64 over the dequantized pages (the
    scale is folded in, not lost), and the write quantizes as quantize_kv does."""
    b = mla_batch(*MIXES["mixed"], seed=11)
    scale = jnp.float32(0.05)
    md = b["md"]
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((NUM_TOKENS, RANK + ROPE)), jnp.float32)
    pages8 = quantize_kv(b["pages"], scale, fmt)
    pages8 = write_latent_pages(pages8, rows[:, :RANK], rows[:, RANK:], md.slot_mapping, scale)
    slots = np.asarray(md.slot_mapping)[:int(md.cu_q_lens[int(md.num_seqs)])]
    flat = np.asarray(pages8.reshape(-1, RANK + ROPE)[slots].astype(jnp.float32))
    np.testing.assert_array_equal(flat, np.asarray(quantize_kv(rows[:len(slots)], scale, fmt).astype(jnp.float32)))
    dense = dense_mla(b, pages=np.asarray(pages8.astype(jnp.float32)) * 0.05)
    b8 = {**b, "pages": pages8}
    for rebuild in (False, True):
        out = mla_attention_xla(b["q_nope"], b["q_rope"], pages8, b["w_uk"], b["w_uv"], md, scale,
                                sm_scale=SM_SCALE, rebuild_prefill=rebuild)
        assert max_error(out, dense) < 1e-5, rebuild
    kernel = absorbed_out(b8, functools.partial(mla_absorbed_attention, interpret=True), latent_scale=scale)
    assert max_error(kernel, dense) < 1e-5


def test_page_holds_exactly_one_latent_row_per_token():
    """A token's slot in a layer's page is kv_lora_rank + qk_rope_head_dim values: c, then k_rope."""
    pages = jnp.zeros((3, PAGE, RANK + ROPE), jnp.float32)
    c = jnp.arange(2 * RANK, dtype=jnp.float32).reshape(2, RANK)
    k_rope = -1.0 - jnp.arange(2 * ROPE, dtype=jnp.float32).reshape(2, ROPE)
    pages = write_latent_pages(pages, c, k_rope, jnp.array([PAGE + 3, 2 * PAGE], jnp.int32))
    assert pages.shape[-1] == RANK + ROPE
    np.testing.assert_array_equal(pages[1, 3], jnp.concatenate([c[0], k_rope[0]]))
    np.testing.assert_array_equal(pages[2, 0], jnp.concatenate([c[1], k_rope[1]]))
    assert int(jnp.count_nonzero(pages)) == 2 * (RANK + ROPE) - 1  # c[0][0] is 0
    with pytest.raises(ValueError, match="latent row"):
        write_latent_pages(pages, c, k_rope[:, :8], jnp.array([1, 2], jnp.int32))


def test_input_errors_name_the_shapes():
    b = mla_batch(*MIXES["mixed"])
    q_lat = absorb_queries(b["q_nope"], b["w_uk"])
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_absorbed_xla(q_lat, b["q_rope"][..., :8], b["pages"], b["md"], sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="w_uk must be"):
        mla_prefill_rebuilt_xla(b["q_nope"], b["q_rope"], b["pages"], b["w_uk"][:, :4], b["w_uv"], b["md"],
                                sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="block_h"):
        mla_absorbed_attention(q_lat, b["q_rope"], b["pages"], b["md"], sm_scale=SM_SCALE, block_h=3, interpret=True)
    with pytest.raises(ValueError, match="block_q \\* block_h=4 must be a power of two >= 16"):
        mla_absorbed_attention(q_lat, b["q_rope"], b["pages"], b["md"], sm_scale=SM_SCALE, block_q=1, block_h=4)


class KernelTests:
    INTERPRET: bool

    def kernel(self, *args, **kw):
        return mla_absorbed_attention(*args, sm_scale=SM_SCALE, interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("mix", list(MIXES))
    def test_kernel_matches_reference(self, mix):
        b = mla_batch(*MIXES[mix], seed=13)
        args = (absorb_queries(b["q_nope"], b["w_uk"]), b["q_rope"], b["pages"], b["md"])
        reference = mla_absorbed_reference(*args, sm_scale=SM_SCALE)
        for kw in ({}, dict(block_q=4, block_h=4, pages_per_block=2)):  # 16 rows: Triton's smallest tile
            assert max_error(self.kernel(*args, **kw), reference) < 1e-5, kw

    def test_bfloat16(self):
        b = mla_batch(*MIXES["mixed"], seed=17, dtype=jnp.bfloat16)
        args = (absorb_queries(b["q_nope"], b["w_uk"]), b["q_rope"], b["pages"], b["md"])
        assert max_error(self.kernel(*args), mla_absorbed_reference(*args, sm_scale=SM_SCALE)) < 2e-2

    def test_new_mix_compiles_nothing(self):
        kernel = jax.jit(functools.partial(self.kernel))
        for mix in MIXES:
            b = mla_batch(*MIXES[mix])
            kernel(absorb_queries(b["q_nope"], b["w_uk"]), b["q_rope"], b["pages"], b["md"]).block_until_ready()
        assert kernel._cache_size() == 1


class TestKernelInterpret(KernelTests):
    INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas needs a GPU")
class TestKernelCompiled(KernelTests):
    INTERPRET = False


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernel_lowers_to_triton(platform):
    """The Pallas-to-Triton step on CPU (Triton's own compile needs the device)."""
    b = mla_batch(*MIXES["mixed"], dtype=jnp.bfloat16)
    args = (absorb_queries(b["q_nope"], b["w_uk"]), b["q_rope"], b["pages"], b["md"])
    fn = jax.jit(functools.partial(mla_absorbed_attention, sm_scale=SM_SCALE, block_q=2, interpret=False))
    assert "xla.gpu.triton" in fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
