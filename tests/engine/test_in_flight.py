"""How many steps the engine keeps in flight (`jaxcpp.core.in_flight`): the pipeline's depth for steps that
carry decodes, twice that while only prompt chunks are in flight; the engine never exceeds it."""

from __future__ import annotations

import pytest

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.in_flight import InFlight
from jaxcpp.sampling_params import SamplingParams


def test_depth_for_decode_steps_twice_that_for_prompt_chunks():
    q: InFlight[int] = InFlight(3)
    for i in range(3):
        assert q.has_room()
        q.append(i, decodes=False)
    assert q.has_room(), "prompt chunks may go deeper than the depth"
    for i in range(3, 6):
        q.append(i, decodes=False)
    assert not q.has_room() and len(q) == 6
    assert q.popleft() == 0 and q.has_room()
    q.append(6, decodes=True)  # a step with a decode: no deeper than the depth until it is collected
    assert not q.has_room()
    while len(q) > 3:
        q.popleft()
    assert not q.has_room()
    q.popleft()
    assert q.has_room() and list(q) == [5, 6]
    with pytest.raises(ValueError, match="depth"):
        InFlight(0)


class CountingFake(FakeExecutor):
    """Records, at each submit, how many steps were in flight, whether one of them carries a decode and
    whether one of them samples (a prompt's last chunk or a decode)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[tuple[int, bool, bool]] = []
        self.decodes: dict[int, bool] = {}

    def submit(self, request):
        self.seen.append((len(self._in_flight), any(self.decodes[i] for i in self._in_flight),
                          any(r.tokens is not None for r, _, _ in self._in_flight.values())))
        self.decodes[request.step_id] = int(request.step.num_decodes) > 0
        return super().submit(request)


def engine_on(fake: FakeExecutor, *, dynamic: bool, async_scheduling: bool = True) -> LLMEngine:
    config = EngineConfig.from_kwargs(model="tiny", max_model_len=2048, max_num_batched_tokens=128, num_pages=300,
                                      pipeline_parallel_size=2, enable_dynamic_chunking=dynamic,
                                      dynamic_chunking_min_chunk_size=64, log_stats_interval_s=0,
                                      async_scheduling=async_scheduling)
    engine = LLMEngine(config, executor=fake)
    if dynamic:
        engine.chunking.install(LatencyModel(a=2e-7, b=1e-4, c=2e-3, gamma=1e-6))
    return engine


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_prompt_runs_deeper_than_the_depth_and_decodes_do_not(dynamic, async_scheduling):
    fake = CountingFake(num_stages=2, latency=LatencyModel(a=2e-7, b=1e-4, c=2e-3, gamma=1e-6))
    engine = engine_on(fake, dynamic=dynamic, async_scheduling=async_scheduling)
    depth = 2 + async_scheduling
    engine.add_request("lone", [5] * 1500, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.chunk_sizer.needs_ack == dynamic
    assert max(n for n, _, _ in fake.seen) == 2 * depth - 1, "prompt chunks fill twice the depth"
    assert all(n < depth for n, decoding, _ in fake.seen if decoding), "no deeper while a step decodes"
    fake.seen.clear()
    for i in range(4):
        engine.add_request(f"d{i}", [7 + i] * 20, SamplingParams(max_tokens=12, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert max(n for n, _, _ in fake.seen) < depth, "steps that decode keep to the depth"
    assert engine.stats().num_pages_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompts_last_chunk_in_flight_does_not_hold_back_the_next_prompts_chunks(async_scheduling):
    """Two concurrent prompts: while the first one's last chunk (it samples) is in the pipe, the second
    one's chunks still go past the depth; the first token of each is exact."""
    fake = CountingFake(num_stages=2, latency=LatencyModel(a=2e-7, b=1e-4, c=2e-3, gamma=1e-6))
    engine = engine_on(fake, dynamic=False, async_scheduling=async_scheduling)
    depth = 2 + async_scheduling
    for name, token in (("a", 5), ("b", 6)):
        engine.add_request(name, [token] * 1000, SamplingParams(max_tokens=1, temperature=0.0))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert any(n >= depth and sampling and not decoding for n, decoding, sampling in fake.seen)
    assert max(n for n, _, _ in fake.seen) == 2 * depth - 1
    expected = {k: [fake.next_token(t, 999, 0)] for k, t in (("a", 5), ("b", 6))}
    assert {k: o.token_ids for k, o in outputs.items()} == expected
