"""Qwen3, Mixtral, Qwen3-MoE and Qwen2-MoE against transformers (PyTorch CPU, float32) on random tiny models.

As tests/models/test_hf_parity.py: a random transformers model with every weight perturbed, saved with
`save_pretrained` (per-expert tensors, as the hub's checkpoints), loaded by our loader (experts stacked at
load); logits to 1e-4 and greedy continuations through the paged path identical. Plus the router's
choices on tied scores, and experts that receive no token or every token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_parity import (
    DIMS,
    assert_matches_transformers,
    needs_torch,
    random_hf_model,
    saved_and_loaded,
    torch,
    transformers,
)

from jaxcpp.models import checkpoint
from jaxcpp.models.moe import dense_experts, grouped_experts, ragged_dot_mlp, route, tiled_grouped_mlp

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)
CASES = {
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    "qwen3-tied-bias": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("qwen3_moe", dict(num_key_value_heads=2, num_experts=8, norm_topk_prob=True, **MOE)),
    # layer 0 dense (mlp_only_layers), layer 1 sparse, raw top-k weights: two runs of unlike layers
    "qwen3-moe-mixed": ("qwen3_moe", dict(num_key_value_heads=2, num_experts=4, norm_topk_prob=False,
                                          mlp_only_layers=[0], **MOE)),
    # q/k/v biases, a gated shared expert of its own width beside the routed ones, a dense layer first
    "qwen2-moe": ("qwen2_moe", dict(num_key_value_heads=2, num_experts=4, norm_topk_prob=False,
                                    shared_expert_intermediate_size=40, mlp_only_layers=[0], **MOE)),
}


@pytest.mark.parity
@needs_torch
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    model, config, params = saved_and_loaded(model_type, overrides, tmp_path)
    if case == "qwen3-moe-mixed":
        assert config.layer_runs() == [(False, 0, 1), (True, 1, 2)] and isinstance(params["layers"], list)
    assert_matches_transformers(model, params, config)


@pytest.mark.parity
@needs_torch
def test_save_hf_round_trips_experts(tmp_path):
    """Our params -> save_hf (per-expert tensors, Mixtral's w1/w3/w2 names) -> load_hf: the same arrays."""
    model = random_hf_model("mixtral", CASES["mixtral"][1])
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config, params = checkpoint.load_hf(tmp_path / "hf")
    checkpoint.save_hf(tmp_path / "ours", params, config)
    _, again = checkpoint.load_hf(tmp_path / "ours")
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, again)
    assert params["layers"]["mlp"]["experts"]["down_proj"]["kernel"].shape == (2, 4, 96, 64)  # [L, E, I, D]


@pytest.mark.parity
@needs_torch
@pytest.mark.parametrize("normalize", [False, True])
def test_router_top_k_equals_transformers_with_ties(normalize):
    """Tokens whose router scores tie (duplicated router rows: experts 2 and 5, 1 and 6 always tie): the
    same experts with the same weights as transformers' Qwen3-MoE router. Within the top k the order
    of tied experts is free (the block's output is a sum); a tie *across* the k-th place is decided by
    the lower expert index here (jax.lax.top_k), while torch's CPU top-k leaves it to its selection
    algorithm (std::nth_element): the all-tied token shows both rules."""
    config = transformers.AutoConfig.for_model("qwen3_moe", **DIMS, num_experts=8, num_experts_per_tok=3,
                                               norm_topk_prob=normalize, moe_intermediate_size=16)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    weight = torch.randn(8, DIMS["hidden_size"])
    weight[5] = weight[2]
    weight[6] = weight[1]
    with torch.no_grad():
        block.gate.weight.copy_(weight)
    x = torch.randn(16, DIMS["hidden_size"])
    x[3] = 0.0  # every expert ties for this token
    with torch.no_grad():
        _, their_weights, their_ids = block.gate(x)
    ours, our_ids = route(jnp.asarray(x.numpy()), jnp.asarray(weight.numpy().T), 3, normalize)
    our_ids, their_ids = np.asarray(our_ids), their_ids.numpy()
    np.testing.assert_allclose(np.asarray(ours), their_weights.numpy(), rtol=1e-5, atol=1e-7)
    probs = torch.softmax(x @ weight.T, dim=-1).numpy()
    boundary = {r for r in range(16) if np.sort(probs[r])[-3] == np.sort(probs[r])[-4]}  # tie at k-th place
    inside = [r for r in range(16) if r not in boundary]
    np.testing.assert_array_equal(np.sort(our_ids[inside], axis=1), np.sort(their_ids[inside], axis=1))
    assert sum(len({2, 5} & set(our_ids[r])) == 2 for r in inside) >= 2  # ties inside the top k happened
    assert 3 in boundary and len(boundary) >= 2
    for r in boundary:  # transformers' choice differs there, ours takes the lower index of the tied ones
        kth = np.sort(probs[r])[-3]
        above = set(np.flatnonzero(probs[r] > kth))
        tied = np.flatnonzero(probs[r] == kth)
        assert set(our_ids[r]) == above | set(tied[:3 - len(above)])
        assert set(their_ids[r]) >= above


def _random_experts(num_experts, d=16, i=24, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (10, d))
    gate = jax.random.normal(keys[1], (num_experts, d, i)) * 0.2
    up = jax.random.normal(keys[2], (num_experts, d, i)) * 0.2
    down = jax.random.normal(keys[3], (num_experts, i, d)) * 0.2
    return x, gate, up, down


def test_expert_with_no_token_and_expert_with_every_token():
    """Every token routes to expert 1 (and one of 0/2); expert 3 gets nothing: the grouped matmul equals
    running every expert densely, and an expert slice holding only the idle expert contributes zero."""
    x, gate, up, down = _random_experts(4)
    ids = jnp.stack([jnp.ones(10, jnp.int32), jnp.arange(10, dtype=jnp.int32) % 2 * 2], axis=1)  # [10, 2]
    weights = jax.random.uniform(jax.random.key(5), (10, 2))
    np.testing.assert_allclose(grouped_experts(x, ids, weights, gate, up, down),
                               dense_experts(x, ids, weights, gate, up, down), atol=1e-5)
    idle = grouped_experts(x, ids, weights, gate[3:], up[3:], down[3:], first_expert=3)
    np.testing.assert_array_equal(idle, np.zeros_like(idle))


def test_expert_slices_sum_to_the_whole():
    """What expert parallelism relies on: the slices' outputs (each with its first expert) add up."""
    x, gate, up, down = _random_experts(8, seed=1)
    weights, ids = route(x, jax.random.normal(jax.random.key(9), (16, 8)), 2, True)
    whole = grouped_experts(x, ids, weights, gate, up, down)
    parts = sum(grouped_experts(x, ids, weights, gate[s:s + 2], up[s:s + 2], down[s:s + 2], first_expert=s)
                for s in range(0, 8, 2))
    np.testing.assert_allclose(parts, whole, atol=1e-5)


@pytest.mark.parity
@needs_torch
@pytest.mark.parametrize("case", ["qwen3", "mixtral", "qwen3-moe-mixed", "qwen2-moe"])
def test_param_counts_equal_transformers(case, tmp_path):
    """ModelConfig.param_counts' total is transformers' parameter count; active counts k of E experts."""
    from jaxcpp.core.sizing import parameter_summary
    from jaxcpp.models.config import ModelConfig

    model_type, overrides = CASES[case]
    model = random_hf_model(model_type, overrides)
    model.config.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    total, active = config.param_counts()
    assert total == sum(p.numel() for p in model.parameters())
    if config.num_experts:
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        moe_layers = config.num_hidden_layers - len(config.dense_layers)
        assert total - active == experts * (config.num_experts - config.num_experts_per_tok) // config.num_experts
        assert experts == moe_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
        assert "active per token" in parameter_summary(config)
    else:
        assert active == total and "active" not in parameter_summary(config)


@pytest.mark.parametrize("num_rows", [3, 40, 700])
def test_tiled_grouped_matmul_equals_ragged_dot(num_rows):
    """The tiled grouped matmul equals jax.lax.ragged_dot's on groups of every kind: empty, smaller than
    a tile, several tiles, and rows past the last group (which give 0)."""
    x, gate, up, down = _random_experts(6, seed=num_rows)
    rows = jax.random.normal(jax.random.key(num_rows), (num_rows, x.shape[1]))
    cuts = np.sort(np.random.default_rng(num_rows).integers(0, num_rows + 1, 6))
    cuts[1] = cuts[0]  # expert 1 gets nothing
    sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts])), jnp.int32)  # sum <= num_rows
    got = jax.jit(tiled_grouped_mlp)(rows, sizes, gate, up, down)
    want = ragged_dot_mlp(rows, sizes, gate, up, down)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(got[int(cuts[-1]):], 0)
