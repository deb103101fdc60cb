"""Broken model folders: truncated safetensors, config.json fields of the wrong type, a tokenizer that a
folder says it has but lacks. Each is a ModelLoadError naming the file and the field or tensor, raised
`from None` (no traceback from inside numpy, json or tokenizers), and `jaxcpp generate` prints it as
one line and exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from jaxcpp.errors import ModelLoadError
from jaxcpp.models import checkpoint, llama
from jaxcpp.models.config import LlamaConfig
from jaxcpp.tokenizer import ByteTokenizer

CONFIG = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(257,))


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    checkpoint.save_hf(folder, llama.init_params(CONFIG, jax.random.key(0)), CONFIG)
    ByteTokenizer().save(folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _raises_clean(folder: Path, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        checkpoint.resolve_model(folder)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    err = info.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), "from None"
    return err


def test_the_good_folder_loads(good_folder) -> None:
    config, _, tokenizer = checkpoint.resolve_model(good_folder)
    assert config == CONFIG and tokenizer is not None


@pytest.mark.parametrize("keep", [0, 5, 8, 20, "half header", "half data", "all but one byte"])
def test_truncated_safetensors_names_the_file(good_folder, tmp_path, keep) -> None:
    folder = _copy(good_folder, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    cut = {"half header": 8 + header_len // 2, "half data": 8 + header_len + (len(data) - 8 - header_len) // 2,
           "all but one byte": len(data) - 1}.get(keep, keep)
    weights.write_bytes(data[:cut])
    _raises_clean(folder, str(weights))


@pytest.mark.parametrize("field, value", [
    ("vocab_size", "300"), ("hidden_size", 32.5), ("num_attention_heads", "4"), ("num_key_value_heads", [2]),
    ("num_hidden_layers", True), ("intermediate_size", None), ("head_dim", "8"), ("rms_norm_eps", "small"),
    ("rope_theta", [10000]), ("tie_word_embeddings", "false"), ("eos_token_id", "</s>"),
    ("bos_token_id", 1.5), ("rope_scaling", "linear"), ("max_position_embeddings", "2048"),
    ("torch_dtype", 16), ("architectures", "LlamaForCausalLM"), ("attention_bias", "yes"),
])
def test_config_json_with_a_wrong_type_names_the_file_and_field(good_folder, tmp_path, field, value) -> None:
    folder = _copy(good_folder, tmp_path / "m")
    d = json.loads((folder / "config.json").read_text())
    d[field] = value
    (folder / "config.json").write_text(json.dumps(d))
    _raises_clean(folder, str(folder / "config.json"), field)


def test_config_json_that_is_not_json_or_not_an_object(good_folder, tmp_path) -> None:
    for i, text in enumerate(['{"vocab_size": 3', "[1, 2]", ""]):
        folder = _copy(good_folder, tmp_path / f"m{i}")
        (folder / "config.json").write_text(text)
        _raises_clean(folder, str(folder / "config.json"))


def test_a_folder_whose_tokenizer_config_promises_a_missing_tokenizer(good_folder, tmp_path) -> None:
    folder = _copy(good_folder, tmp_path / "m")
    (folder / "byte_tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    _raises_clean(folder, str(folder / "tokenizer.json"), "tokenizer_config.json")
    (folder / "tokenizer_config.json").unlink()  # no tokenizer files at all: token ids only, by design
    assert checkpoint.resolve_model(folder)[2] is None


def test_a_corrupt_tokenizer_names_the_file(good_folder, tmp_path) -> None:
    folder = _copy(good_folder, tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"model": ')
    _raises_clean(folder, str(folder / "tokenizer.json"))
    (folder / "tokenizer.json").unlink()
    (folder / "byte_tokenizer.json").write_text('{"type": "byte", "bos_token_id": "x"}')
    _raises_clean(folder, str(folder / "byte_tokenizer.json"))


def test_jaxcpp_generate_prints_one_line_and_exits_2(good_folder, tmp_path, capsys) -> None:
    from jaxcpp.serving.cli import main

    folder = _copy(good_folder, tmp_path / "m")
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**d, "hidden_size": "32"}))
    assert main(["generate", "--model", str(folder), "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "hidden_size" in err and str(folder / "config.json") in err
