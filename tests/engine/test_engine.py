"""Engine behaviour on the CPU backend: bad input, sampling, preemption, abort, compile guard."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxcpp import SamplingParams
from jaxcpp.errors import InvalidRequestError
from jaxcpp.runtime.compile_guard import forbid_compile


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(max_num_batched_tokens=128, max_model_len=512, record_logits=False)


def run_until_done(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def assert_no_leak(engine):
    s = engine.stats()
    assert s.num_pages_used == 0 and s.num_running == 0 and s.num_waiting == 0


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt"),
    ([4] * 600, SamplingParams(max_tokens=1), "prompt"),
    ([3] * 500, SamplingParams(max_tokens=20), "max_tokens"),
    ([3, 10**6], SamplingParams(), "prompt_token_ids"),
    ([3, -1], SamplingParams(), "prompt_token_ids"),
])
def test_bad_request_names_field_and_engine_keeps_serving(llm, prompt, params, field):
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field and field in str(err.value)
    outs = run_until_done(engine)
    assert list(outs) == ["good"] and len(outs["good"].token_ids) == 4
    assert_no_leak(engine)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=1e308), "temperature"),  # finite in Python, infinite as the device's float32
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    run_until_done(engine)
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p)[0].token_ids
    crowd = llm.generate(prompt_token_ids=[[9, 9, 9, 9], [5, 6, 7], [11] * 30],
                         sampling_params=[SamplingParams(max_tokens=12, temperature=1.0), p, SamplingParams()])
    assert crowd[1].token_ids == alone
    other = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=99))[0].token_ids
    assert other != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=10, temperature=0))
    topk1 = llm.generate(prompt_token_ids=[[5, 6, 7]],
                         sampling_params=SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=3))
    assert greedy[0].token_ids == topk1[0].token_ids


def test_stop_token_and_max_tokens(llm):
    free = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop = free.token_ids[3]
    cut = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_abort_frees_pages_and_reports(llm):
    engine = llm.engine
    engine.add_request("keep", [5] * 40, SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("drop", [6] * 300, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("never-existed")
    outs = run_until_done(engine)
    assert outs["drop"].finish_reason == "abort" and outs["keep"].finish_reason == "length"
    assert_no_leak(engine)


@pytest.mark.slow
def test_preemption_gives_the_unpressured_outputs(make_llm):
    prompts = [[3 + (7 * i + j) % 200 for j in range(40 + 13 * i)] for i in range(8)]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True)
    params = [greedy if i % 2 else seeded for i in range(8)]
    roomy = make_llm(max_num_batched_tokens=128, max_model_len=256, num_pages=200, record_logits=False)
    want = [o.token_ids for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params)]
    tight = make_llm(max_num_batched_tokens=128, max_model_len=256, num_pages=24, record_logits=False)
    got = tight.generate(prompt_token_ids=prompts, sampling_params=params)
    assert tight.engine.stats().num_preemptions_total > 0, "the workload should not fit 23 pages"
    assert [o.token_ids for o in got] == want
    assert_no_leak(tight.engine)


@pytest.mark.slow
def test_nothing_compiles_after_warmup_for_200_random_requests(llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 300))] for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.7, 1.0]),
                             top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1000))
              for _ in prompts]
    before = llm.engine.stats().num_compilations_since_warmup  # process-wide: other tests' engines count
    with forbid_compile():
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert len(outs) == 200 and all(o.finished for o in outs)
    assert llm.engine.stats().num_compilations_since_warmup == before
    assert_no_leak(llm.engine)


def test_metrics_are_recorded(llm):
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=5, temperature=0))[0]
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and m.e2e >= m.ttft
    assert len(m.itl) == 4 and all(x >= 0 for x in m.itl)
    assert np.isclose(m.ttft + sum(m.itl), m.e2e, atol=1e-3)


def test_compile_guard_catches_a_compile():
    import jax
    import jax.numpy as jnp

    from jaxcpp.runtime.compile_guard import CompileAfterWarmupError

    with pytest.raises(CompileAfterWarmupError):
        with forbid_compile():
            jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))
