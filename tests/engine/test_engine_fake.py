"""The real engine, scheduler and chunk controller on the fake executor: host only, milliseconds.

Also the two sizing bugs fixed with the executor contract: a chunk the controller sized on purpose is
never padded by the decodes that share its step, and calibration pairs each timing with the token count
that actually ran (the padded bucket).
"""

from __future__ import annotations

import pytest

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.executor import ExecutorError, StepResult
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PP_FLAGS = dict(model="tiny", max_model_len=2048, max_num_batched_tokens=512, pipeline_parallel_size=2,
                num_pages=300, log_stats_interval_s=0, enable_dynamic_chunking=True,
                dynamic_chunking_min_chunk_size=64, dynamic_chunking_smooth_factor=1.0)


def engine(executor: FakeExecutor | None = None, **flags) -> LLMEngine:
    base = dict(model="tiny", max_model_len=512, max_num_batched_tokens=64, log_stats_interval_s=0)
    return LLMEngine(EngineConfig.from_kwargs(**{**base, **flags}), executor=executor or FakeExecutor())


def run(e: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        e.add_request(request_id, prompt, params)
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    return done


def first_outputs(e: LLMEngine) -> list:
    """Step until a step returns something: with async scheduling the first step only submits."""
    while not (outs := e.step()):
        pass
    return outs


def prompts(n: int, length: int) -> dict[str, list[int]]:
    return {f"r{i}": [(7 * i + j) % 250 + 1 for j in range(length)] for i in range(n)}


def test_tokens_follow_the_rule_whatever_the_batching_and_pages():
    work = prompts(12, 94)  # 6 pages each, and a 7th as their decodes cross a page boundary
    roomy = run(engine(), work)
    tight = engine(num_pages=20, max_model_len=256)  # 19 usable pages for 12 x 7: preemptions
    squeezed = run(tight, work)
    assert tight.scheduler.num_preemptions > 0
    for request_id, prompt in work.items():
        assert roomy[request_id] == squeezed[request_id] == FakeExecutor.expected_tokens(prompt, 6)
    s = tight.stats()
    assert (s.num_pages_used, s.num_running, s.num_waiting, s.num_compilations_since_warmup) == (0, 0, 0, 0)
    assert s.num_generation_tokens_total == 12 * 6  # every sampled token once, recomputes included


def test_a_chunk_sized_on_purpose_is_never_padded_by_the_decodes_beside_it():
    fake = FakeExecutor(num_stages=2)
    e = engine(fake, **PP_FLAGS)
    e.chunking.install(LatencyModel(a=1.0, b=100.0, c=0.0, gamma=0.0))
    for request_id, prompt in prompts(3, 20).items():  # three decodes running beside the long prompt
        e.add_request(request_id, prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(20):  # the decodes' prompts are done and the sole-prefill gate has seen quiet steps
        e.step()
    e.add_request("long", [5] * 1500, GREEDY)
    while e.has_unfinished_requests():
        e.step()
    mixed = [s for s in fake.steps if 0 < int(s.num_decodes) < int(s.num_seqs)]
    sized = [s for s in mixed if int(s.kv_lens[int(s.num_decodes)]) < 1500]  # not the prompt's remainder
    assert sized, "no step mixed decodes with a model-sized chunk"
    for s in sized:
        assert int(s.cu_q_lens[-1]) == s.num_tokens_padded, "the decodes pushed the chunk into a larger bucket"


def test_calibration_pairs_timings_with_the_padded_size_that_ran():
    fake = FakeExecutor(num_stages=2, latency=LatencyModel(a=1e-9, b=1e-5, c=1e-3, gamma=1e-7))
    e = engine(fake, **PP_FLAGS)
    recorded = []
    record = e.chunking.record_timing
    e.chunking.record_timing = lambda n, *rest: (recorded.append(n), record(n, *rest))  # type: ignore[method-assign]
    run(e, {"a": [3] * 700})  # 512 + 188: the remainder runs padded to the next bucket
    assert recorded, "no sole-prefill timing reached the controller"
    assert set(recorded) <= set(e.sizing.token_buckets)
    assert max(recorded) == 512 and min(recorded) >= 192


def test_a_failing_executor_fails_the_requests_in_flight_and_frees_their_pages():
    class FailingOnce(FakeExecutor):
        failures = 1

        def collect(self, step_id: int) -> StepResult:
            result = super().collect(step_id)
            if self.failures:
                self.failures -= 1
                raise ExecutorError("garbage from the device", stage=0, fatal=False)
            return result

    e = engine(FailingOnce())
    e.add_request("a", [1, 2, 3], GREEDY)
    outs = first_outputs(e)
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("a", "error", True)]
    assert e.stats().num_pages_used == 0 and not e.has_unfinished_requests()
    assert run(e, {"b": [1, 2, 3]})["b"] == FakeExecutor.expected_tokens([1, 2, 3], 6)  # it recovered


def test_a_fatal_executor_error_propagates_after_failing_its_requests():
    class Dead(FakeExecutor):
        def submit(self, request) -> None:
            raise ExecutorError("stage process exited with signal 9", stage=1)

    e = engine(Dead())
    e.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(ExecutorError, match="stage 1: stage process exited"):
        e.step()
    assert e.stats().num_pages_used == 0 and not e.has_unfinished_requests()


def test_garbage_tokens_fail_only_their_step():
    class Garbage(FakeExecutor):
        bad = 1

        def collect(self, step_id: int) -> StepResult:
            result = super().collect(step_id)
            if self.bad and result.tokens is not None:
                self.bad -= 1
                result.tokens[:] = 10**6
            return result

    e = engine(Garbage())
    e.add_request("a", [1, 2, 3], GREEDY)
    outs = first_outputs(e)
    assert [(o.finish_reason, "outside the vocabulary" in (o.error or "")) for o in outs] == [("error", True)]
    assert e.stats().num_pages_used == 0
    assert run(e, {"b": [4, 5]})["b"] == FakeExecutor.expected_tokens([4, 5], 6)
