"""Host-fast checks of the pipeline's pieces: device check, layer split, sharding specs, stage params."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.sizing import stage_layers
from jaxcpp.models.config import LlamaConfig
from jaxcpp.runtime.mesh import check_devices, make_mesh, stage_mesh
from jaxcpp.runtime.sharding import kv_spec, layer_spec, param_specs


def config(**kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return LlamaConfig(**{**base, **kw})


def test_mesh_has_pp_rows_of_tp_devices():
    mesh = make_mesh(4, 2)
    assert mesh.axis_names == ("pp", "tp") and mesh.devices.shape == (4, 2)
    row = stage_mesh(mesh, 2)
    assert row.axis_names == ("tp",) and list(row.devices) == list(mesh.devices[2])


def test_too_few_devices_is_a_config_error_that_says_how_to_get_more():
    with pytest.raises(ConfigError) as e:
        check_devices(8, 2)
    msg = str(e.value)
    assert "16 devices" in msg and f"sees {len(jax.devices())} cpu" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in msg


def test_engine_refuses_a_mesh_bigger_than_the_machine(random_model):
    from jaxcpp import LLM

    with pytest.raises(ConfigError, match="needs 16 devices"):
        LLM(model=random_model, pipeline_parallel_size=4, tensor_parallel_size=4, max_model_len=64)


@pytest.mark.parametrize(("layers", "pp", "want"), [
    (6, 4, [1, 1, 2, 2]),      # extra layers go to the later stages
    (8, 4, [2, 2, 2, 2]),
    (26, 4, [6, 6, 7, 7]),
    (5, 1, [5]),
])
def test_default_split_puts_extra_layers_last(layers, pp, want):
    bounds = stage_layers(layers, pp)
    assert [e - s for s, e in bounds] == want
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_explicit_partition_and_its_errors():
    assert stage_layers(26, 4, [6, 6, 6, 8]) == [(0, 6), (6, 12), (12, 18), (18, 26)]
    with pytest.raises(ConfigError, match="sum to the model's 26"):
        stage_layers(26, 4, [6, 6, 6, 6])
    with pytest.raises(ConfigError, match="at least 4 decoder layers"):
        stage_layers(3, 4)
    with pytest.raises(ConfigError, match="--pp-partition"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, pp_partition="1,2,3")


def test_megatron_specs_and_fallback_to_replicated():
    c = config()
    assert layer_spec(("self_attn", "q_proj", "kernel"), c, 2) == P(None, None, "tp")
    assert layer_spec(("self_attn", "k_proj", "bias"), c, 2) == P(None, "tp")
    assert layer_spec(("self_attn", "o_proj", "kernel"), c, 2) == P(None, "tp", None)
    assert layer_spec(("mlp", "down_proj", "kernel"), c, 2) == P(None, "tp", None)
    assert layer_spec(("input_layernorm", "scale"), c, 2) == P()
    assert kv_spec(c, 2) == P(None, None, None, "tp", None)
    # 2 KV heads do not split 4 ways: K/V projections and pages replicate, queries still split.
    assert kv_spec(c, 4) == P()
    assert layer_spec(("self_attn", "k_proj", "kernel"), c, 4) == P()
    assert layer_spec(("self_attn", "q_proj", "kernel"), c, 4) == P(None, None, "tp")
    assert layer_spec(("self_attn", "q_proj", "kernel"), c, 1) == P()


def test_per_layer_params_and_specs_drop_the_layer_axis():
    """A CPU stage holds each layer's weights apart (--layer-weights): every run of an MoE model with a dense
    layer unstacked, each leaf's spec the stacked one without the layer axis (experts still split)."""
    from jaxcpp.models import llama
    from jaxcpp.runtime.stage import PER_LAYER_MIN_BYTES, holds_layers_apart, per_layer

    c = config(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               dense_layers=(1,), architecture="Qwen3MoeForCausalLM")
    params = jax.tree_util.tree_map(np.asarray, llama.init_params(c, jax.random.key(0)))
    layers, specs = per_layer(params, param_specs(params, c, 2))
    assert [len(run) for run in layers["layers"]] == [1, 1, 1] and [len(run) for run in specs["layers"]] == [1, 1, 1]
    q = layers["layers"][2][0]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(q, params["layers"][2]["self_attn"]["q_proj"]["kernel"][0])
    assert specs["layers"][1][0]["self_attn"]["q_proj"]["kernel"] == P(None, "tp")
    assert specs["layers"][1][0]["mlp"]["down_proj"]["kernel"] == P("tp", None)
    assert specs["layers"][0][0]["mlp"]["experts"]["up_proj"]["kernel"] == P("tp")  # [E, D, I]: by expert
    assert specs["layers"][0][0]["input_layernorm"]["scale"] == P() and specs["embed"] == P()
    assert holds_layers_apart("auto", "cpu", PER_LAYER_MIN_BYTES) and not holds_layers_apart("auto", "gpu", 2**40)
    assert not holds_layers_apart("auto", "cpu", PER_LAYER_MIN_BYTES - 1)  # the test suite's models: stacked
    assert holds_layers_apart("per-layer", "gpu", 0) and not holds_layers_apart("stacked", "cpu", 2**40)


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
@pytest.mark.parametrize("tied", [False, True])
def test_stage_params_split_embedding_head_and_layers(tied, fmt, tmp_path):
    """Each stage reads only its own part of the checkpoint, in either format."""
    from jaxcpp.models.checkpoint import load_stage_params, save_hf, save_orbax
    from jaxcpp.models.llama import init_params
    from jaxcpp.models.spec import resolve_model_spec

    c = config(tie_word_embeddings=tied)
    params = jax.tree_util.tree_map(np.asarray, init_params(c, jax.random.key(0)))
    (save_hf if fmt == "hf" else save_orbax)(tmp_path, params, c)
    spec = resolve_model_spec(tmp_path)
    assert spec.format == fmt
    first, middle, last = (load_stage_params(spec, (s, e), s == 0, e == 6) for s, e in [(0, 1), (1, 3), (3, 6)])
    assert set(first) == {"layers", "embed"}
    assert set(middle) == {"layers"}
    assert set(last) == ({"layers", "norm", "embed"} if tied else {"layers", "norm", "lm_head"})
    q = params["layers"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(middle["layers"]["self_attn"]["q_proj"]["kernel"], q[1:3])
    specs = param_specs(last, c, 2)
    if tied:  # the head is the embedding, whole on every device of the stage
        assert "lm_head" not in specs and specs["embed"] == P()
    else:     # [D, V]: each device holds half the vocabulary's columns
        assert specs["lm_head"] == P(None, "tp")
    assert specs["norm"] == P()
