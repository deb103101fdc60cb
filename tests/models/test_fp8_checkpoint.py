"""FP8 checkpoints: Linear weights stored in F8_E4M3 with per-tensor or per-channel `weight_scale`, the
`--quantization fp8` load of a float checkpoint, and the KV-cache scales a checkpoint may carry."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxcpp.errors import ModelLoadError
from jaxcpp.models import checkpoint, llama, safetensors_file
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.spec import resolve_model_spec

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(3,))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    checkpoint.save_hf(folder, llama.init_params(CONFIG, jax.random.key(0)), CONFIG)
    return folder


def write_fp8_copy(src, dst, *, per_tensor: bool = False, drop: str | None = None, extra=None):
    """The float checkpoint with every decoder Linear in F8_E4M3 + weight_scale ([out, 1] per channel, the
    compressed-tensors / fbgemm layout, or a scalar), as HF fp8 checkpoints store them."""
    tensors = {name: np.asarray(safetensors_file.SafetensorsFile(src / "model.safetensors").get(name))
               for name in safetensors_file.SafetensorsFile(src / "model.safetensors").header}
    out = {}
    for name, w in tensors.items():
        if name.endswith(".weight") and any(f".{lin}." in name for lin in LINEARS):
            if per_tensor:
                scale = np.float32(np.abs(w).max() / 448.0)
                q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
                out[name], out[name + "_scale"] = q, np.asarray(scale, np.float32).reshape(())
            else:
                q, scale = checkpoint.quantize_fp8_per_channel(w.T)  # ours is [in, out]
                out[name], out[name + "_scale"] = np.ascontiguousarray(q.T), scale.reshape(-1, 1)
        else:
            out[name] = w
    if drop is not None:
        del out[drop]
    out.update(extra or {})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def load(folder, layers=(0, 3), quantization=None):
    return checkpoint.load_stage_params(resolve_model_spec(folder), layers, True, True, quantization)


def test_fp8_checkpoint_loads_as_fp8_and_equals_quantize_at_load(float_folder, tmp_path):
    fp8 = load(write_fp8_copy(float_folder, tmp_path / "fp8"))
    at_load = load(float_folder, quantization="fp8")
    q_proj = fp8["layers"]["self_attn"]["q_proj"]
    assert q_proj["kernel"].dtype == ml_dtypes.float8_e4m3fn and q_proj["kernel"].shape == (3, 32, 32)
    assert q_proj["kernel_scale"].dtype == np.float32 and q_proj["kernel_scale"].shape == (3, 32)
    assert fp8["embed"].dtype == np.float32 and fp8["layers"]["input_layernorm"]["scale"].dtype == np.float32
    assert jax.tree_util.tree_structure(fp8) == jax.tree_util.tree_structure(at_load)
    for a, b in zip(jax.tree_util.tree_leaves(fp8), jax.tree_util.tree_leaves(at_load), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_per_tensor_scale_is_repeated_per_channel(float_folder, tmp_path):
    params = load(write_fp8_copy(float_folder, tmp_path / "pt", per_tensor=True), layers=(1, 3))
    scale = params["layers"]["mlp"]["up_proj"]["kernel_scale"]
    assert scale.shape == (2, 48)
    assert (scale == scale[:, :1]).all() and (scale[0] != scale[1]).any()  # one per layer
    w = np.asarray(safetensors_file.SafetensorsFile(float_folder / "model.safetensors").get(
        "model.layers.1.mlp.up_proj.weight")).T
    deq = params["layers"]["mlp"]["up_proj"]["kernel"][0].astype(np.float32) * scale[0]
    np.testing.assert_allclose(deq, w, atol=np.abs(w).max() / 16)  # e4m3: 3 mantissa bits


def test_missing_scale_is_named(float_folder, tmp_path):
    folder = write_fp8_copy(float_folder, tmp_path / "bad", drop="model.layers.2.mlp.down_proj.weight_scale")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.down_proj\.weight_scale"):
        load(folder)


def test_block_wise_scales_are_refused_by_name(float_folder, tmp_path):
    folder = write_fp8_copy(float_folder, tmp_path / "block", drop="model.layers.0.mlp.down_proj.weight_scale",
                            extra={"model.layers.0.mlp.down_proj.weight_scale_inv": np.ones((1, 1), np.float32)})
    with pytest.raises(ModelLoadError, match="block-wise"):
        load(folder)


def test_kv_scales_from_the_checkpoint(float_folder, tmp_path):
    spec = resolve_model_spec(float_folder)
    assert checkpoint.load_kv_scales(spec, (0, 3)) is None  # none stored: the cache uses 1.0
    extra = {f"model.layers.{i}.self_attn.k_scale": np.asarray(0.5 + i, np.float32) for i in (0, 2)}
    extra |= {f"model.layers.{i}.self_attn.v_scale": np.asarray(0.25 * (i + 1), np.float32) for i in (0, 2)}
    spec = resolve_model_spec(write_fp8_copy(float_folder, tmp_path / "kv", extra=extra))
    k, v = checkpoint.load_kv_scales(spec, (0, 3))
    np.testing.assert_array_equal(k, [0.5, 1.0, 2.5])  # layer 1 has none: 1.0
    np.testing.assert_array_equal(v, [0.25, 1.0, 0.75])
    k, v = checkpoint.load_kv_scales(spec, (2, 3))  # a stage reads its own layers' scales
    np.testing.assert_array_equal(k, [2.5])
    extra["model.layers.0.self_attn.v_scale"] = np.asarray(0.0, np.float32)
    spec = resolve_model_spec(write_fp8_copy(float_folder, tmp_path / "kv0", extra=extra))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_scale / .*must be finite and > 0"):
        checkpoint.load_kv_scales(spec, (0, 3))
