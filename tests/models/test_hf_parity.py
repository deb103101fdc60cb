"""Parity with Hugging Face transformers (PyTorch CPU, float32) on random tiny models.

Each case builds a random transformers model, perturbs every weight (norms and biases included, which
HF initialises to ones and zeros), saves it with `save_pretrained`, loads the folder with our loader
and compares logits (to 1e-4) and greedy continuations (identical; ours through the paged path).
"""

import importlib
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_metadata import build_metadata

from jaxcpp.models import checkpoint, llama
from jaxcpp.models.config import LlamaConfig


def optional(name: str) -> ModuleType | None:
    """The module, or None where the parity extra (torch, transformers) is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


torch = optional("torch")
transformers = optional("transformers")
# Only the tests that need them skip without them (not the whole module: tests/models/test_moe_parity.py's
# jax-only tests import this module's helpers and run everywhere). Each is marked `parity` too.
needs_torch = pytest.mark.skipif(torch is None or transformers is None,
                                 reason="needs torch and transformers (the parity extra)")
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (the parity extra)")

PAGE_SIZE, T, PROMPT_LEN, NEW_TOKENS = 4, 32, 12, 10
DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-gqa-tied-llama3": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                            rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama-attention-bias": ("llama", dict(num_key_value_heads=2, attention_bias=True)),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": ("mistral", dict(num_key_value_heads=2, head_dim=32, sliding_window=None)),
}


def random_hf_model(model_type, overrides, seed=0):
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(model_type, **DIMS, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # large enough that logits are far apart and greedy choices are not near-ties
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_greedy(params, config, prompt):
    """Prefill the prompt, then decode one token a step, all through forward + compute_logits."""

    @jax.jit
    def step(p, ids, kv, md):
        hidden, kv = llama.forward(p, ids, kv, md, config)
        return llama.compute_logits(p, hidden, config), kv

    pages = list(range(1, 9))
    kv = llama.make_kv_cache(config, config.num_hidden_layers, 16, PAGE_SIZE, jnp.float32)
    ids = jnp.asarray(prompt + [0] * (T - len(prompt)), jnp.int32)
    logits, kv = step(params, ids, kv, build_metadata([(pages, 0, len(prompt))], T, PAGE_SIZE))
    out = [int(jnp.argmax(logits[len(prompt) - 1]))]
    while len(out) < NEW_TOKENS:
        pos = len(prompt) + len(out) - 1
        ids = jnp.asarray([out[-1]] + [0] * (T - 1), jnp.int32)
        logits, kv = step(params, ids, kv, build_metadata([(pages, pos, 1)], T, PAGE_SIZE))
        out.append(int(jnp.argmax(logits[0])))
    return out


def saved_and_loaded(model_type, overrides, folder):
    """A random transformers model saved with `save_pretrained` (as the hub's checkpoints are), and the
    config and params our loader reads back from the folder."""
    model = random_hf_model(model_type, overrides)
    model.save_pretrained(folder, safe_serialization=True)
    config, params = checkpoint.load_hf(folder)
    assert config.model_type == model_type
    return model, config, params


def assert_matches_transformers(model, params, config) -> None:
    """Logits of two random 24-token rows within 1e-4 of transformers' (and far from zero), and greedy
    tokens through the paged path identical to its `generate`."""
    ids = np.random.default_rng(0).integers(0, DIMS["vocab_size"], (2, 24)).tolist()
    ours = np.asarray(llama.forward_dense(params, jnp.asarray(ids, jnp.int32), config))
    theirs = hf_logits(model, ids)
    assert np.abs(theirs).max() > 1.0  # not a degenerate near-zero comparison
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    prompt = ids[0][:PROMPT_LEN]
    assert our_greedy(params, config, prompt) == hf_greedy(model, prompt)


@pytest.mark.parity
@needs_torch
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    model, config, params = saved_and_loaded(model_type, overrides, tmp_path)
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert ("lm_head" in params) != config.tie_word_embeddings
    assert_matches_transformers(model, params, config)


@pytest.mark.parity
@needs_torch
def test_save_hf_round_trips_to_transformers(tmp_path):
    """Our random Qwen2 params -> save_hf -> transformers.from_pretrained gives the same logits."""
    config = LlamaConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **DIMS,
                                       "num_key_value_heads": 2, "tie_word_embeddings": True})
    params = llama.init_params(config, jax.random.key(0))
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree_util.tree_unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                                 for x, k in zip(leaves, keys, strict=True)])
    checkpoint.save_hf(tmp_path, params, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ids = np.random.default_rng(1).integers(0, DIMS["vocab_size"], (1, 20)).tolist()
    ours = np.asarray(llama.forward_dense(params, jnp.asarray(ids, jnp.int32), config))
    np.testing.assert_allclose(ours, hf_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parity
@needs_transformers
def test_mistral_config_parsing(tmp_path):
    hf_config = transformers.MistralConfig(**{**DIMS, "max_position_embeddings": 32768},
                                           num_key_value_heads=2, sliding_window=4096)
    hf_config.architectures = ["MistralForCausalLM"]
    hf_config.save_pretrained(tmp_path)
    config = LlamaConfig.from_pretrained(tmp_path)
    assert config.architecture == "MistralForCausalLM" and config.num_key_value_heads == 2
    assert config.sliding_window == 4096 and config.max_position_embeddings == 4096  # capped, see docs
    theta = getattr(hf_config, "rope_parameters", None) or {"rope_theta": hf_config.rope_theta}
    assert config.rope_theta == theta["rope_theta"]
