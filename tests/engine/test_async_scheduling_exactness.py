"""Async scheduling on the real model (CPU backend): the same tokens as the synchronous engine.

A mixed workload on one device and on a 2-stage pipeline: greedy and seeded requests, a stop token,
an abort, and few enough pages that requests are preempted. Placeholder decodes read their input
token from the step still in flight (the first stage's `fed_back` array), nothing compiles after
warm-up, and every page comes back.
"""

from __future__ import annotations

import pytest

from jaxcpp import SamplingParams

NUM_REQUESTS = 8
FLAGS = dict(max_num_batched_tokens=128, max_model_len=256, num_pages=24, page_size=16, record_logits=False)


def workload() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(NUM_REQUESTS):
        prompt = [3 + (7 * i + j) % 200 for j in range(30 + 11 * i)]
        if i % 3 == 0:
            params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11 + i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                    stop_token_ids=[97] if i == 4 else [])
        out.append((prompt, params))
    return out


def run(llm):
    """Requests arrive over the first steps; r5 is aborted at step 6."""
    engine, feedbacks = llm.engine, []
    submit = engine.executor.submit

    def counting(request):
        feedbacks.append(request.feedback_from is not None)
        return submit(request)

    engine.executor.submit = counting
    done, step = {}, 0
    try:
        while step < NUM_REQUESTS or engine.has_unfinished_requests():
            if step < NUM_REQUESTS:
                prompt, params = workload()[step]
                engine.add_request(f"r{step}", prompt, params)
            if step == 6:
                engine.abort_request("r5")
            done.update({o.request_id: o for o in engine.step() if o.finished})
            step += 1
    finally:
        engine.executor.submit = submit
    return done, sum(feedbacks)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_async_scheduling_gives_the_synchronous_tokens(make_llm, pp):
    sync = make_llm(**FLAGS, pipeline_parallel_size=pp, async_scheduling=False)
    want, fed_back = run(sync)
    assert fed_back == 0
    llm = make_llm(**FLAGS, pipeline_parallel_size=pp)
    got, fed_back = run(llm)
    assert fed_back > 0, "no step read its tokens from the step in flight"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0, "the workload should not fit 23 pages"
    assert stats.num_compilations_since_warmup == 0 and stats.num_pages_used == 0
    assert got["r5"].finish_reason == "abort" and got["r4"].finish_reason == want["r4"].finish_reason
    assert any(o.finish_reason == "stop" for o in want.values()), "the stop token should end a request"
    for request_id in set(want) - {"r5"}:
        assert got[request_id].token_ids == want[request_id].token_ids, request_id
        assert got[request_id].finish_reason == want[request_id].finish_reason, request_id
    llm.close()
    sync.close()
