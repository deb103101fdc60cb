"""Each new family from a Hugging Face folder written by transformers, through the user's commands:
`jaxcpp generate` gives transformers' greedy tokens, `jaxcpp serve` answers over gRPC with them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxcpp.serving.cli import main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.parity]  # each compiles an engine
PROMPT = [5, 17, 33, 2, 90, 41, 8]
NEW = 6
DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
FAMILIES = {
    "qwen3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    # MLA: a latent cache; V3 with q LoRA, YaRN and the grouped sigmoid router, V2-Lite without q LoRA
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1,
                        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
    "deepseek_v2": dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=2),
}
FLAGS = ["--dtype", "float32", "--max-model-len", "64", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
         "--log-stats-interval-s", "0"]


def hf_folder(model_type: str, folder) -> tuple[str, list[int]]:
    """A random transformers model saved to `folder`, and its greedy continuation of PROMPT."""
    torch.manual_seed(1)
    config = transformers.AutoConfig.for_model(model_type, **{**DIMS, **FAMILIES[model_type]})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_generate_command_gives_transformers_greedy_tokens(model_type, tmp_path, capsys):
    folder, want = hf_folder(model_type, tmp_path)
    argv = ["generate", "--model", folder, "--prompt-token-ids", ",".join(map(str, PROMPT)),
            "--max-tokens", str(NEW), "--ignore-eos", "--temperature", "0", *FLAGS]
    assert main(argv) == 0
    assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == want


def test_serve_command_serves_an_moe_folder(tmp_path):
    from jaxcpp.serving import Client

    folder, want = hf_folder("qwen3_moe", tmp_path / "model")
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", folder, "--port", "0",
           "--http-port", "0", "--shutdown-grace-s", "5", "--log-level", "warning", *FLAGS]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("jaxcpp: serving"), (line, log.read_text())
        with Client(line.split(" on ")[1].split()[0], timeout=120) as client:
            out = client.generate(PROMPT, max_tokens=NEW, temperature=0, ignore_eos=True)
        assert list(out.token_ids) == want
    finally:
        proc.terminate()
        proc.wait(timeout=60)
