"""Checkpoint I/O: orbax and safetensors round trips, sharded HF folders, bundled `tiny`, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxcpp.errors import ModelLoadError
from jaxcpp.models import checkpoint, llama, safetensors_file
from jaxcpp.models.config import LlamaConfig
from jaxcpp.tokenizer import ByteTokenizer

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                     eos_token_ids=(3,))


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, jax.random.key(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, params, dtype):
    config = CONFIG.replace(dtype=dtype, tie_word_embeddings=dtype == "bfloat16")
    p = llama.init_params(config, jax.random.key(1), jnp.dtype(dtype))
    checkpoint.save_orbax(tmp_path / "ckpt", p, config)
    loaded_config, loaded = checkpoint.load_orbax(tmp_path / "ckpt")
    assert loaded_config == config
    assert_same(loaded, p)
    _, as_f32 = checkpoint.load_orbax(tmp_path / "ckpt", dtype="float32")
    assert jax.tree_util.tree_leaves(as_f32)[0].dtype == jnp.float32


def test_hf_round_trip_and_names(tmp_path, params):
    checkpoint.save_hf(tmp_path, params, CONFIG)
    header = safetensors_file.SafetensorsFile(tmp_path / "model.safetensors").header
    assert header["model.layers.1.self_attn.q_proj.weight"]["shape"] == [32, 32]  # [out, in]
    assert header["model.layers.0.mlp.gate_proj.weight"]["shape"] == [48, 32]
    assert header["lm_head.weight"]["shape"] == [64, 32]
    config, loaded = checkpoint.load_hf(tmp_path)
    assert config == CONFIG
    assert_same(loaded, params)


def test_sharded_folder_with_index(tmp_path, params):
    checkpoint.save_hf(tmp_path / "one", params, CONFIG)
    tensors = safetensors_file.SafetensorsFile(tmp_path / "one" / "model.safetensors")
    names = sorted(tensors.header)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    for shard, shard_names in shards.items():
        save_file({n: np.asarray(tensors.get(n)) for n in shard_names}, str(folder / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (folder / safetensors_file.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    _, loaded = checkpoint.load_hf(folder, dtype="bfloat16")
    assert_same(loaded, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors: shard listed"):
        checkpoint.load_hf(folder)


def test_tied_folder_ignores_lm_head(tmp_path):
    config = CONFIG.replace(tie_word_embeddings=True)
    p = llama.init_params(config, jax.random.key(2))
    checkpoint.save_hf(tmp_path, p, config)
    assert "lm_head" not in checkpoint.load_hf(tmp_path)[1]


def test_load_errors_name_file_and_tensor(tmp_path, params):
    with pytest.raises(ModelLoadError, match=r"config\.json: not found"):
        checkpoint.resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match="neither a bundled model"):
        checkpoint.resolve_model(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        checkpoint.load_hf(tmp_path)
    one_layer = {**params, "layers": jax.tree_util.tree_map(lambda x: x[:1], params["layers"])}
    checkpoint.save_hf(tmp_path, one_layer, CONFIG.replace(num_hidden_layers=1))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    with pytest.raises(ModelLoadError, match="'model.layers.1.input_layernorm.weight' missing"):
        checkpoint.load_hf(tmp_path)
    checkpoint.save_hf(tmp_path, params, CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.replace(hidden_size=16).to_hf_dict()))
    with pytest.raises(ModelLoadError, match="safetensors: tensor 'model.embed_tokens.weight' has shape"):
        checkpoint.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG.to_hf_dict(), "architectures": ["Phi3"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: architectures: unsupported architecture 'Phi3'"):
        checkpoint.resolve_model(tmp_path)


def test_resolve_orbax_folder_with_byte_tokenizer(tmp_path, params):
    config = CONFIG.replace(vocab_size=264)
    checkpoint.save_orbax(tmp_path, llama.init_params(config, jax.random.key(3)), config)
    ByteTokenizer().save(tmp_path)
    resolved_config, _, tok = checkpoint.resolve_model(str(tmp_path), dtype="bfloat16")
    assert resolved_config.dtype == "bfloat16" and isinstance(tok, ByteTokenizer)


def test_bundled_tiny_resolves_and_writes_python():
    folder = checkpoint.BUNDLED_MODELS["tiny"]
    if not (folder / "params").is_dir():
        pytest.fail(f"bundled checkpoint missing: run scripts/train_tiny.py (expected {folder})")
    config, params, tok = checkpoint.resolve_model("tiny")
    assert isinstance(tok, ByteTokenizer) and config.vocab_size >= tok.vocab_size
    prompt = [tok.bos_token_id, *tok.encode("import os\n\n\ndef main(")]
    ids = jnp.asarray([prompt + [tok.pad_token_id] * 32], jnp.int32)
    step = jax.jit(lambda p, x, i: jnp.argmax(llama.forward_dense(p, x, config)[0, i]))
    for n in range(len(prompt), len(prompt) + 32):
        ids = ids.at[0, n].set(step(params, ids, n - 1))
    text = tok.decode(np.asarray(ids[0, len(prompt):]).tolist())
    assert text.isascii() and any(word in text for word in ("self", "=", "(", ":", "\n"))
