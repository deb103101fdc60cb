"""Block-wise fp8 checkpoints (DeepSeek-V3 / Kimi-K2's layout): every decoder Linear stored in F8_E4M3
with `weight_scale_inv` [ceil(out/B), ceil(in/B)] (one multiplier a B x B block), `quantization_config`
{"quant_method": "fp8", "weight_block_size": [B, B], "activation_scheme": "dynamic"}. Loaded by
dequantizing block by block and quantizing again per output channel (models/fp8.py)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxcpp.errors import ModelLoadError
from jaxcpp.models import checkpoint, llama
from jaxcpp.models.fp8 import requantize_blockwise
from jaxcpp.models.safetensors_file import SafetensorsFile
from tests.pipeline.test_deepseek_pipeline import deepseek_config

BLOCK = 16  # DeepSeek's is 128; the tiny model's matrices are 24-96 wide, so 16 gives several blocks


def block_quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (fp8 [out, in], scale_inv [ceil(out/B), ceil(in/B)]): DeepSeek's fp8 cast."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = np.ones((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = max(np.abs(part).max(), 1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).astype(q.dtype)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:q.shape[0], :q.shape[1]]
    return q.astype(np.float32) * full


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(float folder holding the block-dequantized weights, the block-fp8 folder of the same model)."""
    config = deepseek_config(num_hidden_layers=3, dense_layers=(0,))
    params = llama.init_params(config, jax.random.key(2))
    root = tmp_path_factory.mktemp("blockfp8")
    checkpoint.save_hf(root / "src", params, config)
    src = SafetensorsFile(root / "src" / "model.safetensors")
    exact, fp8 = {}, {}
    for name in src.header:
        w = np.asarray(src.get(name))
        linear = ".layers." in name and name.endswith(".weight") and w.ndim == 2 and ".gate.weight" not in name
        if linear:
            q, scale = block_quantize(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            exact[name] = dequantize(q, scale, BLOCK)
        else:
            exact[name] = fp8[name] = w
    for folder, tensors in (("exact", exact), ("fp8", fp8)):
        (root / folder).mkdir()
        save_file(tensors, str(root / folder / "model.safetensors"))
        d = json.loads((root / "src" / "config.json").read_text())
        if folder == "fp8":
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [BLOCK, BLOCK]}
        (root / folder / "config.json").write_text(json.dumps(d))
    return root / "exact", root / "fp8"


def test_block_fp8_checkpoint_loads_as_per_channel_fp8_of_its_exact_weights(folders):
    """Loading the block-fp8 folder gives, bit for bit, what `--quantization fp8` makes of the same weights
    block-dequantized exactly: fp8 kernels with one scale per output channel (experts: per expert)."""
    exact_folder, fp8_folder = folders
    _, fp8 = checkpoint.load_hf(fp8_folder)
    spec = checkpoint.resolve_model_spec(exact_folder)
    at_load = checkpoint.load_stage_params(spec, (0, 3), True, True, quantization="fp8")
    kv_b = fp8["layers"][1]["self_attn"]["kv_b_proj"]
    assert kv_b["kernel"].dtype == jnp.float8_e4m3fn and kv_b["kernel_scale"].shape == (2, 4 * (16 + 24))
    experts = fp8["layers"][1]["mlp"]["experts"]["down_proj"]
    assert experts["kernel"].dtype == jnp.float8_e4m3fn and experts["kernel_scale"].shape == (2, 8, 64)
    assert fp8["layers"][1]["mlp"]["gate"]["kernel"].dtype == jnp.float32  # the router stays as stored
    assert jax.tree_util.tree_structure(fp8) == jax.tree_util.tree_structure(at_load)
    for a, b in zip(jax.tree_util.tree_leaves(fp8), jax.tree_util.tree_leaves(at_load), strict=True):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_block_fp8_logits_within_fp8_tolerance(folders):
    """The accuracy cost of one scale a channel instead of a block: logits against the exactly
    block-dequantized model (printed; measured in the report)."""
    exact_folder, fp8_folder = folders
    config, exact = checkpoint.load_hf(exact_folder)
    _, fp8 = checkpoint.load_hf(fp8_folder)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 16)), jnp.int32)
    want = np.asarray(llama.forward_dense(exact, ids, config))
    got = np.asarray(llama.forward_dense(fp8, ids, config))
    error = np.abs(got - want).max() / np.abs(want).max()
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    print(f"block fp8 -> per-channel: max |logit error| / max |logit| = {error:.4f}, argmax agreement {agree:.2f}")
    assert error < 0.25 and agree >= 0.75


def test_selection_bias_stays_float32_in_a_bfloat16_model(folders):
    """The router's e_score_correction_bias decides which experts run: float32 whatever the model dtype
    (transformers keeps it so), while the weights take the requested dtype."""
    exact_folder, _ = folders
    spec = checkpoint.resolve_model_spec(exact_folder, "bfloat16")
    params = checkpoint.load_stage_params(spec, (0, 3), True, True)
    gate = params["layers"][1]["mlp"]["gate"]
    assert gate["e_score_correction_bias"].dtype == np.float32 and gate["kernel"].dtype == ml_dtypes.bfloat16


def test_requantize_blockwise_per_channel_error():
    """Requantized per channel, each value is within half an e4m3 step at the channel's top of its exact
    block-dequantized value, for blocks of very unlike scale."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 56)).astype(np.float32) * np.linspace(0.01, 1, 56)  # blocks of unlike scale
    q, scale = block_quantize(w, BLOCK)
    kernel, channel = requantize_blockwise(np.ascontiguousarray(q.T), scale, BLOCK)
    assert kernel.shape == (56, 40) and channel.shape == (40,)
    block_exact = dequantize(q, scale, BLOCK).T
    error = np.abs(kernel.astype(np.float32) * channel - block_exact) / channel  # in units of the channel scale
    assert error.max() <= 16 * (1 + 1e-5)  # half of e4m3's largest step (32, between 256 and 448)


def test_block_scale_that_does_not_tile_is_named(folders, tmp_path):
    _, fp8_folder = folders
    f = SafetensorsFile(fp8_folder / "model.safetensors")
    tensors = {name: np.asarray(f.get(name)) for name in f.header}
    tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((fp8_folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv.*tile"):
        checkpoint.load_hf(tmp_path / "bad")
