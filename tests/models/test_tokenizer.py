"""Tokenizers: byte and HF round trips, and incremental detokenization that never splits a character."""

import json

import pytest

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import LlamaConfig
from jaxcpp.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)

TEXT = "def f(x):\n    return 'héllo wörld → 世界 🎉'\n"


def stream(tok, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.step(i) for i in ids]
    return deltas, detok.flush()


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def return hello world", "héllo wörld"] * 20, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and max(ids) < 256
    assert tok.decode([tok.bos_token_id, *ids, *tok.eos_token_ids, tok.pad_token_id]) == TEXT
    assert tok.vocab_size == 259 and tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # half a character decodes with errors="replace"


def test_byte_tokenizer_save_and_load(tmp_path):
    ByteTokenizer().save(tmp_path)
    config = LlamaConfig(vocab_size=264, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    tok = load_tokenizer(tmp_path, config)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == (257,)
    with pytest.raises(ModelLoadError, match="byte_tokenizer.json"):
        load_tokenizer(tmp_path, config.replace(vocab_size=100))
    (tmp_path / "byte_tokenizer.json").write_text(json.dumps({"type": "byte"}))
    with pytest.raises(ModelLoadError, match="byte_tokenizer.json"):
        load_tokenizer(tmp_path, config)
    assert load_tokenizer(tmp_path / "nothing", config) is None


def test_incremental_bytes_never_split_a_character():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    deltas, rest = stream(tok, ids)
    assert "".join(deltas) + rest == TEXT and rest == ""
    assert all("\ufffd" not in d for d in deltas)
    first = ids.index(0xE4)  # 世 = E4 B8 96: nothing until its third byte arrives
    assert deltas[first] == deltas[first + 1] == "" and deltas[first + 2] == "世"
    assert deltas[-2] == "🎉" or "🎉" in deltas


def test_incremental_flush_and_specials():
    tok = ByteTokenizer()
    deltas, rest = stream(tok, [*b"ok", 256, 0xF0, 0x9F])  # BOS mid-stream, then half an emoji
    assert "".join(deltas) == "ok" and rest == "\ufffd"
    deltas, rest = stream(tok, [0xFF, *b"a"])  # an invalid byte is emitted once it is followed
    assert "".join(deltas) + rest == "\ufffda"


def test_hf_tokenizer_round_trip_and_incremental(hf_tokenizer_file):
    tok = HFTokenizer(hf_tokenizer_file, bos_token_id=0, eos_token_ids=(1,))
    assert isinstance(tok, Tokenizer) and tok.vocab_size <= 300
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.decode([0, *ids, 1]) == TEXT
    deltas, rest = stream(tok, ids, prompt_ids=tok.encode("hello"))
    assert "".join(deltas) + rest == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(TEXT.encode()) // 4  # the emoji is split over byte-level tokens


def test_load_tokenizer_prefers_tokenizer_json(hf_tokenizer_file):
    config = LlamaConfig(vocab_size=300, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, bos_token_id=0,
                         eos_token_ids=(1,))
    ByteTokenizer().save(hf_tokenizer_file.parent)
    tok = load_tokenizer(hf_tokenizer_file.parent, config)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (1,)


def test_bad_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        HFTokenizer(tmp_path / "tokenizer.json")
