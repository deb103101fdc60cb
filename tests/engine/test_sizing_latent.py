"""Sizing a latent (MLA) KV cache: a page holds kv_lora_rank + qk_rope_head_dim values a token a layer; the
KV layout a disaggregated producer and consumer compare says so."""

import dataclasses
from dataclasses import dataclass

import pytest

from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.sizing import EngineSizing, kv_values_per_token, page_bytes, pages_in_memory
from jaxcpp.models.spec import resolve_model_spec


@dataclass(frozen=True)
class LatentConfig:
    """The fields sizing reads, as an MLA config.json names them (DeepSeek-V3's values, 8 layers)."""

    num_hidden_layers: int = 8
    num_key_value_heads: int = 128
    head_dim: int = 192  # qk_nope_head_dim + qk_rope_head_dim: what a per-head cache would hold
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    architecture: str = "DeepseekV3ForCausalLM"


def test_latent_page_holds_one_row_of_rank_plus_rope_a_token_a_layer():
    latent = LatentConfig()
    assert kv_values_per_token(latent) == 576  # type: ignore[arg-type]
    assert page_bytes(latent, 8, 16, "bfloat16") == 8 * 16 * 576 * 2  # type: ignore[arg-type]
    assert page_bytes(latent, 8, 16, "float8_e4m3fn") == 8 * 16 * 576  # type: ignore[arg-type]
    tiny = resolve_model_spec("tiny", "float32").config  # per-head K and V, as before
    assert kv_values_per_token(tiny) == 2 * tiny.num_key_value_heads * tiny.head_dim
    assert pages_in_memory(latent, 8, 16, "bfloat16", 1.0) == 2**30 // (8 * 16 * 576 * 2)  # type: ignore[arg-type]


def test_engine_sizing_plans_latent_pages():
    """EngineSizing.plan sizes a latent cache by its rows: 1 GB at PP 2 (4 layers a stage) holds
    2**30 / (4 · 16 · 576 · 2) = 14563 pages, where K/V of 128 heads of 192 would hold 170."""
    spec = dataclasses.replace(resolve_model_spec("tiny", "float32"), config=LatentConfig())
    config = EngineConfig.from_kwargs(model="tiny", pipeline_parallel_size=2, max_model_len=4096,
                                      max_num_seqs=256, kv_cache_memory_gb=1.0)
    sizing = EngineSizing.plan(config, spec)  # type: ignore[arg-type]
    assert sizing.num_pages == 2**30 // (4 * 16 * 576 * 2) == 14563
    per_head = dataclasses.replace(LatentConfig(), kv_lora_rank=0)
    assert pages_in_memory(per_head, 4, 16, "bfloat16", 1.0) == 170  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        EngineSizing.plan(config, dataclasses.replace(spec, config=per_head))  # type: ignore[arg-type]


def test_a_disaggregated_mla_model_plans_and_describes_its_latent_pages():
    """--kv-transfer-config with an MLA model starts (its latent pages cross, tests/disagg/
    test_mla_disaggregation.py), and its KV layout says what a page holds: one shared head of
    kv_lora_rank + qk_rope_head_dim values. An MHA layout, or a latent one of another rank, differs in
    fields a refusal names, and the layout crosses the wire whole (an old peer's reads as MHA)."""
    from jaxcpp.serving.disaggregation import layout_from_proto, layout_to_proto
    from jaxcpp.serving.gen import jaxcpp_pb2 as pb

    spec = dataclasses.replace(resolve_model_spec("tiny", "float32"), config=LatentConfig())
    config = EngineConfig.from_kwargs(model="tiny", max_model_len=4096, kv_cache_memory_gb=1.0,
                                      kv_transfer_config='{"kv_role": "kv_producer"}')
    latent = EngineSizing.plan(config, spec).kv_layout()  # type: ignore[arg-type]
    assert (latent.num_kv_heads, latent.head_dim, latent.kv_lora_rank, latent.qk_rope_head_dim) == (1, 576, 512, 64)
    mha = EngineSizing.plan(config, dataclasses.replace(spec, config=dataclasses.replace(  # type: ignore[arg-type]
        LatentConfig(), kv_lora_rank=0, num_key_value_heads=2, head_dim=64))).kv_layout()
    assert latent.mismatch(mha, "this consumer", "producer p:1") == (
        "KV layouts differ: num_kv_heads 1 (this consumer) vs 2 (producer p:1); "
        "head_dim 576 (this consumer) vs 64 (producer p:1); kv_lora_rank 512 (this consumer) vs 0 (producer p:1); "
        "qk_rope_head_dim 64 (this consumer) vs 0 (producer p:1)")
    other_rank = dataclasses.replace(latent, head_dim=448, kv_lora_rank=384)
    assert "kv_lora_rank 512 (a) vs 384 (b)" in str(latent.mismatch(other_rank, "a", "b"))
    assert layout_from_proto(layout_to_proto(latent)) == latent
    old_peer = pb.KvLayout(model="tiny", num_layers=8, page_size=16, kv_cache_dtype="float32", num_kv_heads=2,
                           head_dim=64)
    assert layout_from_proto(old_peer) == dataclasses.replace(mha, kv_cache_dtype="float32")
