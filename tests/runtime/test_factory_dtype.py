"""`--dtype auto` on the CPU backend loads float32 (bfloat16 is emulated there, several times slower);
an explicit dtype is honoured; on other backends auto keeps the checkpoint's dtype."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxcpp.models import checkpoint, llama
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.spec import resolve_model_spec
from jaxcpp.runtime.factory import resolve_dtype

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(3,), dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    checkpoint.save_orbax(folder, llama.init_params(CONFIG, jax.random.key(0), jnp.bfloat16), CONFIG)
    return folder


def load(folder, requested: str) -> tuple[str, set[str]]:
    """What the engine does without an executor handed in: the device side resolves the dtype, the head
    plans with it, each stage loads its params in it."""
    spec = resolve_model_spec(folder, resolve_dtype(requested))
    params = checkpoint.load_stage_params(spec, (0, CONFIG.num_hidden_layers), True, True)
    return spec.config.dtype, {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(params)}


def test_auto_means_float32_on_cpu_and_is_logged(bf16_folder, caplog) -> None:
    assert jax.default_backend() == "cpu"
    with caplog.at_level(logging.INFO, logger="jaxcpp.runtime"):
        planned, loaded = load(bf16_folder, "auto")
    assert planned == "float32" and loaded == {"float32"}
    assert any("--dtype auto on the CPU backend: float32" in r.getMessage() for r in caplog.records)


def test_explicit_bfloat16_is_honoured_on_cpu(bf16_folder) -> None:
    assert load(bf16_folder, "bfloat16") == ("bfloat16", {"bfloat16"})


@pytest.mark.parametrize(("requested", "backend", "expected"), [
    ("auto", "cpu", "float32"), ("auto", "gpu", "auto"), ("auto", "tpu", "auto"),
    ("bfloat16", "cpu", "bfloat16"), ("float16", "gpu", "float16"),
])
def test_resolve_dtype(requested: str, backend: str, expected: str) -> None:
    assert resolve_dtype(requested, backend) == expected
