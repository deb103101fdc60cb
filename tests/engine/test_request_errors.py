"""One request's bad value must not take the engine down (issue 34, item 1).

Every integer that reaches a step's int32 arrays is range-checked where requests are validated
(`SamplingParams`, for every front end); and whatever validation still lets through, an exception
raised while building one request's part of a step input fails that request (reason "error", pages
freed), not the engine: the other requests of the same step finish as if it had never been there."""

from __future__ import annotations

import pytest

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def engine(**flags) -> LLMEngine:
    base = dict(model="tiny", max_model_len=512, max_num_batched_tokens=64, log_stats_interval_s=0)
    return LLMEngine(EngineConfig.from_kwargs(**{**base, **flags}), executor=FakeExecutor())


def drain(e: LLMEngine) -> dict[str, object]:
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return done


@pytest.mark.parametrize("values, field", [
    (dict(top_k=2**31), "top_k"),
    (dict(min_tokens=1, stop_token_ids=(2**31,)), "stop_token_ids"),
    (dict(stop_token_ids=(-2**31 - 1,)), "stop_token_ids"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(min_tokens=2**31, max_tokens=2**31), "max_tokens"),
    (dict(top_p=1e-320), "top_p"),       # 0 in float32: every token would be token 0
    (dict(top_p=1e-46), "top_p"),
    (dict(repetition_penalty=1e-320), "repetition_penalty"),  # 0 in float32: the device divides by it
    (dict(n=True), "n"),
])
def test_values_past_the_device_arrays_are_refused_naming_the_field(values, field) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**values)
    assert refused.value.field == field


def test_the_largest_int32_values_and_tiny_float32_values_are_served() -> None:
    e = engine()
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, top_k=2**31 - 1, top_p=1e-30, min_tokens=1,
                                                 stop_token_ids=(2**31 - 1, -2**31), seed=2**63 - 1))
    out = drain(e)["a"]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("steps_first", [0, 4])  # fails in its prefill; in a decode, among fed-back decodes
def test_a_failure_building_one_requests_step_input_fails_only_that_request(steps_first: int) -> None:
    e = engine()
    expected = {}
    for rid in ("before", "after"):  # the same prompts alone: what they must produce beside the bad one
        alone = engine()
        alone.add_request(rid, [5, 6, 7] if rid == "before" else [8, 9], GREEDY)
        expected[rid] = drain(alone)[rid].token_ids
    e.add_request("before", [5, 6, 7], GREEDY)
    e.add_request("bad", [1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    e.add_request("after", [8, 9], GREEDY)
    for _ in range(steps_first):
        assert not [o for o in e.step() if o.finished]
    # What validation would refuse, slipped in after it (as a check it lacks would): an int32 overflow.
    object.__setattr__(e.scheduler.requests["bad"].params, "top_k", 2**31)
    done = drain(e)
    assert done["bad"].finish_reason == "error"
    assert "OverflowError" in done["bad"].error, done["bad"].error
    assert {rid: done[rid].token_ids for rid in ("before", "after")} == expected
    assert e.allocator.num_used == 0 and not e.scheduler.requests
    e.add_request("next", [8, 9], GREEDY)  # and the engine serves on
    assert drain(e)["next"].token_ids == expected["after"]


def test_an_error_no_request_causes_alone_is_the_engines(monkeypatch) -> None:
    import jaxcpp.core.engine as engine_module

    e = engine()
    e.add_request("a", [1, 2], GREEDY)
    e.add_request("b", [3, 4], GREEDY)

    def broken(sched, shape):  # the whole step fails, but each request built alone does not
        if len(sched.chunks) > 1:
            raise RuntimeError("the engine's own bug")
        return real(sched, shape)

    real = engine_module.build_step_input
    monkeypatch.setattr(engine_module, "build_step_input", broken)
    with pytest.raises(RuntimeError, match="the engine's own bug"):
        drain(e)
