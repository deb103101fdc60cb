"""Prefix caching on a two-stage pipeline is exact, including a request admitted onto pages whose
writing step is still in flight (submitted, not yet through both stages): each stage runs steps in
submission order, so the later step reads what the earlier one wrote. Reference: one device, no cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 128, n)]


@pytest.mark.slow
def test_pp2_prefix_caching_matches_one_device_without_cache(pp_llm, random_model):
    llm = pp_llm(model=random_model, pipeline_parallel_size=2, tensor_parallel_size=1, pp_partition=None)
    engine = llm.engine
    engine.scheduler.forget_cached_pages()
    prefix = tokens(0, 100)
    work = {"writer": prefix + tokens(1, 20), "early": prefix[:64] + tokens(2, 10),
            "later": prefix + tokens(3, 30), "whole": list(prefix)}
    engine.add_request("writer", work["writer"], GREEDY)
    engine.step()  # the writer's first 64-token chunk is submitted: pages 0-3 published
    assert len(engine._in_flight) == 1
    engine.add_request("early", work["early"], GREEDY)  # admitted next step, beside the chunk in flight
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id in ("later", "whole"):
        outs[request_id] = llm.generate(prompt_token_ids=[work[request_id]], sampling_params=GREEDY)[0]
    assert outs["early"].num_cached_tokens == 64
    assert outs["later"].num_cached_tokens == 96 and outs["whole"].num_cached_tokens == 96
    ref_llm = pp_llm(model=random_model, enable_prefix_caching=False)
    refs = ref_llm.generate(prompt_token_ids=list(work.values()), sampling_params=GREEDY)
    for request_id, ref in zip(work, refs, strict=True):
        out = outs[request_id]
        assert out.token_ids == ref.token_ids, request_id
        np.testing.assert_allclose(np.stack(out.logits), np.stack(ref.logits), atol=1e-5, rtol=0)
    assert engine.stats().num_pages_used == 0
