"""The "Engine status" line: rates over the interval's busy time, due on a timer while there is work,
silent while the engine idles."""

from __future__ import annotations

import logging
import re
import time

import pytest

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.outputs import EngineStats
from jaxcpp.core.stats_logger import StatsLogger
from jaxcpp.sampling_params import SamplingParams

STATS = EngineStats(num_running=1, num_waiting=0, num_pages_used=1, num_pages_free=9, num_pages_total=10,
                    num_compilations_since_warmup=0, num_prompt_tokens_total=0, num_generation_tokens_total=0,
                    num_preemptions_total=0, dynamic_chunking={})
RATES = re.compile(r"prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rates(caplog: pytest.LogCaptureFixture) -> list[tuple[float, float]]:
    return [tuple(map(float, RATES.search(r.getMessage()).groups()))  # type: ignore[union-attr,misc]
            for r in caplog.records if r.getMessage().startswith("Engine status")]


def test_rates_are_over_busy_time_and_an_idle_engine_is_never_due(caplog) -> None:
    clock = Clock()
    stats = StatsLogger(interval_s=5.0, clock=clock)
    stats.generation_tokens_total += 150  # one second of work at 150 tok/s
    stats.add_busy(1.0)
    clock.now += 1.0
    assert not stats.due()  # the interval is not over
    clock.now += 10.0        # then ten seconds idle
    assert stats.due()
    with caplog.at_level(logging.INFO, logger="jaxcpp.core.engine"):
        stats.log(STATS, None)
    assert rates(caplog) == [(0.0, 150.0)]  # not 150 / 11 s
    clock.now += 60.0  # a minute idle: nothing worked since the line, so none is due
    stats.add_busy(0.0)
    assert not stats.due()


def test_the_engine_logs_while_it_works_and_its_rates_ignore_the_idle_gap(caplog) -> None:
    config = EngineConfig.from_kwargs(model="tiny", max_model_len=256, max_num_batched_tokens=64,
                                      log_stats_interval_s=0.2)
    engine = LLMEngine(config, executor=FakeExecutor(step_delay_s=0.01))  # ~100 decode steps a second
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(request_id: str) -> None:
        engine.add_request(request_id, [1, 2, 3], params)
        while engine.has_unfinished_requests():
            engine.step()

    with caplog.at_level(logging.INFO, logger="jaxcpp.core.engine"):
        run("a")
        lines_while_working = len(rates(caplog))
        time.sleep(1.0)
        for _ in range(20):  # steps with nothing to do, as an idle loop might make: no line, no busy time
            engine.step()
        assert len(rates(caplog)) == lines_while_working
        run("b")
    engine.close()
    assert lines_while_working >= 1  # a 30-token request at ~100 tok/s spans the 0.2 s interval
    decode = [d for _, d in rates(caplog)]
    assert len(decode) > lines_while_working  # the second request logged too
    # One stream: at most ~100 tokens a second of busy time, and never the few tokens per second an
    # average over the idle second would give.
    assert all(20 < d < 200 for d in decode), decode
