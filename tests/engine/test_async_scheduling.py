"""Async scheduling on the host: the real engine and scheduler on fake executors, no jax.

Step k+1 is scheduled while step k is in flight; a decode whose input token step k samples gets a
placeholder and reads it on the device (`feedback_rows`). Outputs must be exactly the synchronous
engine's, a token scheduled past a stop must be dropped with its pages freed, and nothing may be
scheduled past max_tokens. The KV-keeping fake reads every context token from its pages, so a
placeholder that read the wrong row, or a page written twice, changes the tokens.
"""

from __future__ import annotations

import argparse

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxcpp.cli_args import add_engine_args, engine_config_from_args
from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.sampling_params import SamplingParams
from tests.engine.kv_fake import KVFakeExecutor

FLAGS = dict(model="tiny", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, page_size=16,
             log_stats_interval_s=0)


def make_engine(executor: FakeExecutor, **flags) -> LLMEngine:
    engine = LLMEngine(EngineConfig.from_kwargs(**{**FLAGS, **flags}), executor=executor)
    if isinstance(executor, KVFakeExecutor):
        executor.allocator = engine.allocator  # no shared or published page is ever written
    return engine


def drain(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def fed_back_tokens(fake: FakeExecutor) -> int:
    return sum(int((s.feedback_rows >= 0).sum()) for s in fake.steps)


def test_decodes_read_their_input_from_the_step_in_flight():
    fake = FakeExecutor()
    engine = make_engine(fake)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    out = drain(engine)["a"]
    assert out.token_ids == FakeExecutor.expected_tokens([5, 6, 7], 8)
    # The prompt, then seven decodes, each scheduled while the step before it was in flight.
    assert len(fake.steps) == 8 and fed_back_tokens(fake) == 7
    decode = fake.steps[1]
    assert decode.feedback_rows[0] == 0 and decode.token_ids[0] == 0  # the host sent a placeholder
    assert [int(s.num_generated[0]) for s in fake.steps] == list(range(8))  # seeds count the pending token


def test_sync_engine_sends_every_token_from_the_host():
    fake = FakeExecutor()
    engine = make_engine(fake, async_scheduling=False)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    assert drain(engine)["a"].token_ids == FakeExecutor.expected_tokens([5, 6, 7], 8)
    assert fed_back_tokens(fake) == 0 and engine._in_flight.depth == fake.max_in_flight


def test_a_token_scheduled_past_a_stop_is_dropped_and_its_pages_freed():
    prompt = [5, 6, 7]
    free = FakeExecutor.expected_tokens(prompt, 10)
    stop = free[3]
    fake = FakeExecutor()
    engine = make_engine(fake)
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop]))
    out = drain(engine)["a"]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(stop) + 1]
    # The step after the stop was already in flight: its token was sampled, then dropped.
    assert len(fake.steps) == len(out.token_ids) + 1
    stats = engine.stats()
    assert stats.num_generation_tokens_total == len(out.token_ids)
    assert stats.num_pages_used == 0 and not engine.has_unfinished_requests()


def test_nothing_is_scheduled_past_max_tokens_or_the_model_length():
    fake = FakeExecutor()
    engine = make_engine(fake, max_model_len=20)
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("long", [1] * 15, SamplingParams(max_tokens=5, ignore_eos=True))
    done = drain(engine)
    assert [len(done[r].token_ids) for r in ("short", "long")] == [4, 5]
    # Every sampling chunk of each request produced a kept token: 4 + 5 samples, none wasted.
    assert sum(int(s.num_seqs) for s in fake.steps) == 4 + 5


def test_an_abort_while_a_placeholder_is_in_flight_frees_everything():
    fake = FakeExecutor()
    engine = make_engine(fake)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    # Between steps one step is in flight, with a placeholder decode of "a" in it.
    assert engine.scheduler.requests["a"].num_pending == 1 and len(engine._in_flight) == 1
    engine.abort_request("a")
    done = drain(engine)
    assert done["a"].finish_reason == "abort"
    assert done["b"].token_ids == FakeExecutor.expected_tokens([8, 9], 6)
    assert engine.stats().num_pages_used == 0


def test_page_pressure_preempts_the_same_victims_as_sync():
    """The newest sequence not in the step is the victim even with its token in flight (with async
    every running decode has one): the oldest request must not preempt itself instead. Same finish
    order and per-request preemptions as sync; the token in flight is kept, then recomputed."""

    def run(async_scheduling: bool) -> tuple[list[str], dict[str, int], int]:
        engine = make_engine(FakeExecutor(), num_pages=7, max_model_len=96, max_num_seqs=8,
                             async_scheduling=async_scheduling)
        preempt, in_flight = engine.scheduler._preempt, []

        def recording_preempt(seq, out):  # type: ignore[no-untyped-def]
            in_flight.append(seq.awaiting_token)
            preempt(seq, out)

        engine.scheduler._preempt = recording_preempt
        prompts = [[1] * 14, [2] * 6, [3] * 10, [4] * 2]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
        seqs = dict(engine.scheduler.requests)
        order = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.token_ids == FakeExecutor.expected_tokens(prompts[int(out.request_id[1])], 60)
                    order.append(out.request_id)
        return order, {r: s.num_preemptions for r, s in seqs.items()}, sum(in_flight)

    sync_order, sync_preemptions, _ = run(False)
    order, preemptions, victims_with_token_in_flight = run(True)
    assert order == sync_order == ["r0", "r1", "r2", "r3"]
    assert preemptions == sync_preemptions and preemptions["r0"] == 0
    assert victims_with_token_in_flight > 0


def test_flag_and_keyword_turn_it_off():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduler.async_scheduling
    assert not engine_config_from_args(parser.parse_args(["--no-async-scheduling"])).scheduler.async_scheduling
    assert not EngineConfig.from_kwargs(model="tiny", async_scheduling=False).scheduler.async_scheduling


PROMPT_TOKENS = st.lists(st.integers(3, 200), min_size=16, max_size=60)
REQUEST = st.tuples(PROMPT_TOKENS, st.integers(1, 30), st.integers(0, 6), st.integers(-1, 30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(REQUEST, min_size=1, max_size=12), num_stages=st.sampled_from([1, 2]),
       num_pages=st.integers(8, 16), stops=st.lists(st.integers(32, 126), max_size=3))
def test_async_outputs_equal_sync_outputs(requests, num_stages, num_pages, stops):
    """Random arrivals, stops, aborts and page pressure (preemption): every request that was not
    aborted gets the synchronous engine's tokens and finish reason; no page is left held."""

    def run(async_scheduling: bool) -> tuple[dict[str, object], set[str], LLMEngine, KVFakeExecutor]:
        fake = KVFakeExecutor(num_stages=num_stages)
        engine = make_engine(fake, num_pages=num_pages, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=96, async_scheduling=async_scheduling)
        done, aborted, step = {}, set(), 0
        while step <= 12 or engine.has_unfinished_requests():
            for i, (prompt, max_tokens, arrive, abort) in enumerate(requests):
                if arrive == step:
                    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                       stop_token_ids=stops))
                if abort == step and arrive <= step and f"r{i}" not in done:
                    aborted.add(f"r{i}")
                    engine.abort_request(f"r{i}")
            done.update({o.request_id: o for o in engine.step() if o.finished})
            step += 1
        return done, aborted, engine, fake

    sync, sync_aborted, _, _ = run(False)
    got, got_aborted, engine, fake = run(True)
    for request_id, out in got.items():
        if request_id in sync_aborted | got_aborted:
            continue  # an abort lands a step later or earlier relative to the tokens
        want = sync[request_id]
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), request_id
    assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.allocator.num_usable
    event(f"fed back: {fed_back_tokens(fake) > 0}")
    event(f"preempted: {engine.stats().num_preemptions_total > 0}")
    event(f"stopped: {any(o.finish_reason == 'stop' for o in got.values())}")


def test_the_engine_reports_each_steps_host_phases():
    """`--trace-file`'s host row: schedule, build, dispatch, wait, postprocess of every step, and with
    async scheduling step k+1's dispatch comes before step k's wait."""
    fake = FakeExecutor()
    engine = make_engine(fake)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    by_step: dict[int, dict[str, object]] = {}
    for p in fake.host_phases:
        by_step.setdefault(p.step, {})[p.name] = p
    submitted = [s for s in by_step.values() if "dispatch" in s]
    assert len(submitted) == len(fake.steps) == 4
    assert all(list(s) == ["schedule", "build", "dispatch", "wait", "postprocess"] for s in submitted)
    assert by_step[1]["dispatch"].end <= by_step[0]["wait"].start  # submitted before the previous was collected
