"""config.json of the newer families: Qwen3's q/k norms, the MoE fields, which layers are dense, and
errors that name the field."""

import pytest

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import ModelConfig

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256}


def parse(arch, **fields):
    return ModelConfig.from_hf_dict({"architectures": [arch], **BASE, **fields})


def test_qwen3_has_qk_norm_and_its_own_head_dim():
    c = parse("Qwen3ForCausalLM", attention_bias=True)
    assert c.qk_norm and c.head_dim == 32 and c.attention_out_bias and c.num_experts == 0
    assert c.layer_runs() == [(False, 0, 6)]


def test_qwen3_moe_dense_layers_from_mlp_only_layers_and_sparse_step():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
    c = parse("Qwen3MoeForCausalLM", **moe, mlp_only_layers=[0, 4], decoder_sparse_step=2, norm_topk_prob=True)
    assert c.dense_layers == (0, 2, 4)  # mlp_only, and (i + 1) % 2 != 0
    assert c.layer_runs() == [(False, 0, 1), (True, 1, 2), (False, 2, 3), (True, 3, 4), (False, 4, 5), (True, 5, 6)]
    assert c.layer_runs(2, 4) == [(False, 2, 3), (True, 3, 4)]
    assert c.norm_topk_prob and c.qk_norm
    assert parse("Qwen3MoeForCausalLM", **moe).dense_layers == ()


def test_mixtral_always_renormalises_and_reads_num_local_experts():
    c = parse("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 96) and c.norm_topk_prob
    assert not c.qk_norm and c.dense_layers == ()


DEEPSEEK = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=2,
                q_lora_rank=None)


@pytest.mark.parametrize("arch, fields", [
    ("DeepseekV2ForCausalLM", DEEPSEEK),
    ("DeepseekV2ForCausalLM", dict(DEEPSEEK, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 64})),
    ("Qwen3ForCausalLM", dict(attention_bias=True)),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
                                 mlp_only_layers=[1, 2], norm_topk_prob=False)),
    ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=24, mlp_only_layers=[0])),
])
def test_round_trip(arch, fields):
    c = parse(arch, **fields)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("arch, fields, field", [
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    ("MixtralForCausalLM", dict(num_experts_per_tok=2), "num_local_experts"),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2), "moe_intermediate_size"),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                 mlp_only_layers=[9]), "mlp_only_layers"),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                 decoder_sparse_step=0), "decoder_sparse_step"),
    ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
     "shared_expert_intermediate_size"),
    ("Phi3ForCausalLM", {}, "architectures"),
    # DeepSeek-V3 is supported now (it was this case's "architectures" refusal): its own fields are named
    ("DeepseekV3ForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8),
     "kv_lora_rank"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, n_group=3), "n_group"),
    ("DeepseekV2ForCausalLM", dict(DEEPSEEK, topk_method="noaux_tc"), "topk_method"),
    ("DeepseekV2ForCausalLM", dict(DEEPSEEK, moe_layer_freq=2), "moe_layer_freq"),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 64}), "rope_scaling.rope_type"),
])
def test_bad_fields_are_named(arch, fields, field):
    with pytest.raises(ModelLoadError, match=rf"config.json: {field}:"):
        parse(arch, **fields)
