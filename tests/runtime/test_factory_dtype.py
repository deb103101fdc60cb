"""`--dtype auto` on the CPU backend loads float32 (bfloat16 is emulated there, several times slower);
an explicit dtype is honoured; on other backends auto keeps the checkpoint's dtype."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxcpp.config import EngineConfig
from jaxcpp.models import checkpoint, llama
from jaxcpp.models.config import LlamaConfig
from jaxcpp.runtime.factory import load_model, resolve_dtype

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(3,), dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    checkpoint.save_orbax(folder, llama.init_params(CONFIG, jax.random.key(0), jnp.bfloat16), CONFIG)
    return folder


def test_auto_means_float32_on_cpu_and_is_logged(bf16_folder, caplog) -> None:
    assert jax.default_backend() == "cpu"
    with caplog.at_level(logging.INFO, logger="jaxcpp.runtime"):
        model = load_model(EngineConfig.from_kwargs(model=str(bf16_folder), num_pages=16))
    assert model.dtype_name == "float32" and model.config.dtype == "float32"
    assert any("--dtype auto on the CPU backend: float32" in r.getMessage() for r in caplog.records)


def test_explicit_bfloat16_is_honoured_on_cpu(bf16_folder) -> None:
    model = load_model(EngineConfig.from_kwargs(model=str(bf16_folder), dtype="bfloat16", num_pages=16))
    assert model.dtype_name == "bfloat16" and model.config.dtype == "bfloat16"


@pytest.mark.parametrize(("requested", "backend", "expected"), [
    ("auto", "cpu", "float32"), ("auto", "gpu", "auto"), ("auto", "tpu", "auto"),
    ("bfloat16", "cpu", "bfloat16"), ("float16", "gpu", "float16"),
])
def test_resolve_dtype(requested: str, backend: str, expected: str) -> None:
    assert resolve_dtype(requested, backend) == expected
