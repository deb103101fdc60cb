"""LlamaConfig parsing from Hugging Face config.json dicts (Llama, Mistral, Qwen2) and its errors."""

import json
import logging

import pytest

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import LlamaConfig

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def hf_dict(arch="LlamaForCausalLM", **overrides):
    d = {
        "architectures": [arch], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not ...}


def test_llama_fields():
    c = LlamaConfig.from_hf_dict(hf_dict(eos_token_id=[2, 7]))
    assert (c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (128, 64, 4, 2)
    assert c.head_dim == 16 and c.num_kv_groups == 2
    assert c.eos_token_ids == (2, 7) and c.bos_token_id == 1
    assert c.dtype == "bfloat16" and c.rope_scaling is None and not c.attention_bias
    assert c.model_type == "llama"


def test_explicit_head_dim_and_kv_heads_default():
    c = LlamaConfig.from_hf_dict(hf_dict(head_dim=32, num_key_value_heads=...))
    assert c.head_dim == 32 and c.num_key_value_heads == 4


def test_llama3_rope_scaling_old_and_new_spelling():
    old = LlamaConfig.from_hf_dict(hf_dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING))
    new = LlamaConfig.from_hf_dict(hf_dict(rope_theta=..., rope_parameters={**LLAMA3_SCALING,
                                                                               "rope_theta": 500000.0}))
    legacy = {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"} | {"type": "llama3"}
    very_old = LlamaConfig.from_hf_dict(hf_dict(rope_theta=500000.0, rope_scaling=legacy))
    assert old == new == very_old
    assert old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    assert old.rope_scaling["original_max_position_embeddings"] == 8192


def test_default_rope_parameters_mean_no_scaling():
    c = LlamaConfig.from_hf_dict(hf_dict(rope_theta=..., rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6}))
    assert c.rope_scaling is None and c.rope_theta == 1e6


def test_mistral_sliding_window(caplog):
    c = LlamaConfig.from_hf_dict(hf_dict("MistralForCausalLM", sliding_window=None))
    assert c.model_type == "mistral" and c.max_position_embeddings == 256 and c.sliding_window is None
    with caplog.at_level(logging.WARNING):
        capped = LlamaConfig.from_hf_dict(hf_dict("MistralForCausalLM", sliding_window=64))
    assert capped.max_position_embeddings == 64 and capped.sliding_window == 64
    assert "sliding_window" in caplog.text


def test_qwen2_has_qkv_bias_only_and_ignores_disabled_window():
    c = LlamaConfig.from_hf_dict(hf_dict("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=False))
    assert c.attention_bias and not c.attention_out_bias
    assert c.sliding_window is None and c.max_position_embeddings == 256
    llama = LlamaConfig.from_hf_dict(hf_dict(attention_bias=True))
    assert llama.attention_bias and llama.attention_out_bias


def test_model_type_infers_architecture():
    d = hf_dict(architectures=..., model_type="qwen2")
    assert LlamaConfig.from_hf_dict(d).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_hf_dict_round_trip(arch):
    c = LlamaConfig.from_hf_dict(hf_dict(arch, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True))
    assert LlamaConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c
    assert hash(c) == hash(LlamaConfig.from_hf_dict(c.to_hf_dict()))  # usable as a static jit arg


@pytest.mark.parametrize("overrides, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": ..., "model_type": "gpt2"}, "model_type"),
    ({"hidden_size": ...}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_errors_name_the_field(overrides, field):
    with pytest.raises(ModelLoadError, match=rf"config\.json: {field}"):
        LlamaConfig.from_hf_dict(hf_dict(**overrides))


def test_from_pretrained_errors_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: not found"):
        LlamaConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: unreadable JSON"):
        LlamaConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict(architectures=["BertModel"])))
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}/config\.json: architectures: .*'BertModel'"):
        LlamaConfig.from_pretrained(tmp_path)
