"""The engine with `--kv-cache-dtype fp8*` and `--quantization fp8` on the bundled model: sizing, what it
reports, and the consistency that must hold with 8-bit pages (chunked = unchunked, Pallas = XLA)."""

from __future__ import annotations

import logging

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxcpp import SamplingParams
from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.models.spec import resolve_model_spec

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompt_text() -> list[int]:
    """Real text (the model was trained on Python source), as byte tokens after BOS."""
    text = b'def read_config(path):\n    """Read a JSON config file and return it as a dict."""\n' * 4
    return [256, *text[:300]]


def plan(**kwargs) -> EngineSizing:
    config = EngineConfig.from_kwargs(model="tiny", max_num_seqs=64, **kwargs)
    return EngineSizing.plan(config, resolve_model_spec("tiny", "bfloat16"))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_are_twice_the_bfloat16_pages(kv_cache_dtype):
    one_mib = 2**20 / 2**30
    bf16 = plan(kv_cache_memory_gb=one_mib, max_model_len=256)
    fp8 = plan(kv_cache_memory_gb=one_mib, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    # tiny: 4 layers x 2 KV heads x 32 dims x 16 tokens x (K, V): 16 KiB per bfloat16 page, 8 KiB in fp8
    assert (bf16.num_pages, fp8.num_pages) == (64, 128)
    assert bf16.kv_cache_dtype == "bfloat16"
    assert fp8.kv_cache_dtype == ("float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "float8_e4m3fn")


def test_flags_are_checked():
    with pytest.raises(ConfigError, match="--calculate-kv-scales: needs an fp8 --kv-cache-dtype"):
        EngineConfig.from_kwargs(calculate_kv_scales=True)
    with pytest.raises(ConfigError, match="--kv-cache-dtype: must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="--quantization: must be fp8"):
        EngineConfig.from_kwargs(quantization="int4")
    assert EngineConfig.from_kwargs(kv_cache_dtype="fp8", calculate_kv_scales=True).cache.is_fp8


@pytest.fixture(scope="module")
def fp8_whole(make_llm):
    return make_llm(kv_cache_dtype="fp8", enable_chunked_prefill=False, max_num_batched_tokens=512,
                    max_model_len=512)


@pytest.mark.slow
def test_reports_the_cache_dtype(fp8_whole, make_llm, caplog):
    info = fp8_whole.engine.model_info()
    assert info.kv_cache_dtype == "float8_e4m3fn" and info.dtype == "float32"
    stage = fp8_whole.engine.executor.stages[0]
    assert stage.kv.k.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(stage.kv.k_scale), np.ones(4))  # tiny stores no scales: 1.0
    with caplog.at_level(logging.INFO):
        llm = make_llm(kv_cache_dtype="fp8_e5m2", max_model_len=256, num_pages=20)
    assert llm.engine.model_info().kv_cache_dtype == "float8_e5m2"
    assert any("KV pages of 16 tokens" in r.getMessage() and r.getMessage().endswith("in float8_e5m2")
               for r in caplog.records)
    assert any("KV cache" in r.getMessage() and "float8_e5m2" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_chunked_equals_unchunked_with_fp8_cache(fp8_whole, make_llm):
    chunked = make_llm(kv_cache_dtype="fp8", max_num_batched_tokens=64, max_model_len=512)
    want = fp8_whole.generate(prompt_token_ids=[prompt_text()], sampling_params=GREEDY)[0]
    got = chunked.generate(prompt_token_ids=[[5, 6, 7], prompt_text()], sampling_params=GREEDY)[1]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_pallas_equals_xla_with_fp8_cache(make_llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(max_model_len=256, num_pages=40, kv_cache_dtype="fp8", max_num_batched_tokens=64)
    xla = make_llm(attention_backend="xla", **kw)
    pallas = make_llm(attention_backend="pallas", **kw)
    prompt = prompt_text()[:150]
    want = xla.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    got = pallas.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_calculated_scales_and_fp8_weights(make_llm):
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True, quantization="fp8", max_model_len=256,
                   num_pages=40, max_num_batched_tokens=64)
    stage = llm.engine.executor.stages[0]
    kernel = stage.params["layers"]["mlp"]["down_proj"]["kernel"]
    assert kernel.dtype == ml_dtypes.float8_e4m3fn
    assert stage.params["layers"]["mlp"]["down_proj"]["kernel_scale"].shape == (4, 128)
    assert not np.asarray(stage.kv.k_scale).any()  # warm-up ran no real token: still to be calculated
    out = llm.generate(prompt_token_ids=[prompt_text()[:100]], sampling_params=GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    scales = np.asarray(jax.device_get(stage.kv.k_scale))
    assert (scales > 0).all() and np.isfinite(scales).all()
    # the next request keeps them
    llm.generate(prompt_token_ids=[prompt_text()[:60]], sampling_params=GREEDY)
    np.testing.assert_array_equal(np.asarray(jax.device_get(stage.kv.k_scale)), scales)


@pytest.mark.slow
def test_prefix_cache_serves_fp8_pages_as_they_are(make_llm):
    """A request whose prefix is cached reads the 8-bit pages the first request wrote: the greedy tokens of
    the same request computed from scratch (with the same 64-token chunks, so the same K/V roundings)."""
    flags = dict(kv_cache_dtype="fp8", max_num_batched_tokens=64, max_model_len=320, num_pages=60)
    on, off = make_llm(**flags), make_llm(**flags, enable_prefix_caching=False)
    prefix = prompt_text()[:200]
    first, second = prefix + [ord("a")] * 5, prefix + [ord("b")] * 9
    outs = [on.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in (first, second)]
    assert [o.num_cached_tokens for o in outs] == [0, 192]
    want = off.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    assert outs[1].token_ids == want.token_ids
    np.testing.assert_allclose(np.stack(outs[1].logits), np.stack(want.logits), atol=1e-3, rtol=0)
