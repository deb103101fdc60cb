"""`--layer-weights per-layer` against `stacked` under PP 2 x TP 2, on the Qwen3-MoE model whose first stage
holds two runs of unlike layers (MoE, dense) and whose experts split over "tp": each layer's weights are
arrays of their own, sharded as the stacked ones without the layer axis, and the engine gives the stacked
engine's tokens, its logits to 1e-6 and its pages (to float32 rounding where unlike runs meet,
tests/models/test_layer_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp.runtime.compile_guard import forbid_compile
from tests.pipeline.test_moe_pipeline import write_random_moe
from tests.pipeline.test_pipeline_exactness import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    return write_random_moe(tmp_path_factory.mktemp("qwen3_moe"), "Qwen3MoeForCausalLM")


def test_per_layer_weights_equal_stacked_under_pp2_tp2(pp_llm, qwen3_moe):
    engines = {weights: pp_llm(model=qwen3_moe, pipeline_parallel_size=2, tensor_parallel_size=2,
                               layer_weights=weights) for weights in ("stacked", "per-layer")}
    stage = engines["per-layer"].engine.executor.stages[0]
    assert stage.per_layer_weights and not engines["stacked"].engine.executor.stages[0].per_layer_weights
    runs = stage.params["layers"]
    assert [len(run) for run in runs] == [1, 1]  # layers 0 (MoE) and 1 (dense), one entry each
    experts = runs[0][0]["mlp"]["experts"]["gate_proj"]["kernel"]
    assert experts.shape == (4, 64, 48) and experts.sharding.shard_shape(experts.shape)[0] == 2  # [E/tp, D, I]
    q = runs[1][0]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.shard_shape(q.shape) == (64, 32)  # [D, H*Dh / tp]: heads split as in the stack
    stacked_q = engines["stacked"].engine.executor.stages[0].params["layers"][1]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q), np.asarray(stacked_q)[0])

    outs = {}
    for weights, llm in engines.items():
        with forbid_compile():
            outs[weights] = run(llm)
    for got, want in zip(outs["per-layer"], outs["stacked"], strict=True):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-6, rtol=0)
    for got_stage, want_stage in zip(*(engines[w].engine.executor.stages for w in ("per-layer", "stacked")),
                                     strict=True):
        np.testing.assert_allclose(np.asarray(got_stage.kv.k), np.asarray(want_stage.kv.k), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(got_stage.kv.v), np.asarray(want_stage.kv.v), atol=1e-5, rtol=0)
