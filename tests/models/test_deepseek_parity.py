"""DeepSeek-V2 / V3 (multi-head latent attention, shared experts, DeepSeek's routers) against
transformers (PyTorch CPU, float32) on random tiny checkpoints written by `save_pretrained`.

As tests/models/test_moe_parity.py: every weight perturbed (and V3's selection bias set non-zero, a
buffer transformers leaves at 0), logits of the dense path within 1e-4 and greedy continuations through
the paged latent cache identical. Cases: V2-Lite's shape (no q LoRA, greedy softmax router, shared
experts), V2 with group-limited routing and a routed scaling factor, V3's shape (q LoRA, YaRN with
mscale != mscale_all_dim so both of DeepSeek's YaRN factors count, interleaved RoPE, sigmoid
group-limited router with the correction bias) and V3 without interleaving.
"""

import json

import pytest
from test_hf_parity import DIMS, assert_matches_transformers

from jaxcpp.models import checkpoint
from jaxcpp.models.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.parity

# eos None: transformers suppresses EOS under min_new_tokens, which our greedy loop does not
MLA = dict(eos_token_id=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
           num_key_value_heads=4)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
CASES = {
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", **MLA, **MOE)),
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=24, n_shared_experts=1, topk_method="group_limited_greedy",
                                       n_group=4, topk_group=2, routed_scaling_factor=16.0, **MLA, **MOE)),
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5, rope_parameters=YARN, **MLA, **MOE)),
    "v3-no-interleave": ("deepseek_v3", dict(q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1,
                                             norm_topk_prob=False, rope_interleave=False, **MLA, **MOE)),
}


def random_deepseek(case, seed=0):
    model_type, overrides = CASES[case]
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(model_type, **DIMS, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                b.copy_(0.5 * torch.randn_like(b))
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    model = random_deepseek(case)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, params = checkpoint.load_hf(tmp_path)
    assert config.is_mla and config.layer_runs() == [(False, 0, 1), (True, 1, 2)]
    assert_matches_transformers(model, params, config)


def test_v3_config_fields_and_mtp_skipped(tmp_path, caplog):
    """The config as read: dense-first layers, the V3 router, YaRN; the MTP layer is named in a log line."""
    model = random_deepseek("v3")
    model.config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["num_nextn_predict_layers"] = 1
    with caplog.at_level("INFO"):
        config = ModelConfig.from_hf_dict(d)
    assert "multi-token-prediction" in caplog.text and "model.layers.2." in caplog.text
    assert (config.router, config.topk_method, config.n_group, config.topk_group) == ("sigmoid", "group_limited", 4, 2)
    assert config.dense_layers == (0,) and config.head_dim == 8 and config.qk_head_dim == 24
    assert config.rope_interleave and config.rope_scaling["rope_type"] == "yarn"
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again == config


@pytest.mark.parametrize("case", ["v2-lite", "v3"])
def test_param_counts_equal_transformers(case, tmp_path):
    model = random_deepseek(case)
    model.config.save_pretrained(tmp_path)
    total, _ = ModelConfig.from_pretrained(tmp_path).param_counts()
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert total == sum(p.numel() for p in model.parameters()) + buffers
