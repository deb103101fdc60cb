"""The garbage collector while serving: start-up's objects are frozen, so a full pass walks only what
serving allocated, and every pause long enough to matter shows in the trace's host row as "gc"."""

from __future__ import annotations

import gc

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.gc_heap import GcWatch
from tests.engine.test_engine_fake import GREEDY, engine, prompts, run


def frozen_engine() -> LLMEngine:
    config = EngineConfig.from_kwargs(model="tiny", max_model_len=512, max_num_batched_tokens=64,
                                      log_stats_interval_s=0)
    return LLMEngine(config, executor=FakeExecutor(), freeze_heap=True)


def test_after_start_up_a_full_collection_has_only_what_serving_allocated_to_walk():
    e = frozen_engine()
    try:
        frozen, walked = gc.get_freeze_count(), len(gc.get_objects())  # get_objects: the collectable ones
        assert frozen > 10_000, "start-up's objects were not frozen"
        assert walked < frozen / 20, (walked, frozen)
        run(e, prompts(4, 40))
        assert len(gc.get_objects()) < frozen / 20  # serving itself leaves little for the collector
    finally:
        e.close()
    assert gc.get_freeze_count() == 0  # closed: what it froze may be collected again


def test_only_an_engine_that_builds_its_executor_freezes_by_default():
    config = EngineConfig.from_kwargs(model="tiny", max_model_len=256, log_stats_interval_s=0)
    e = LLMEngine(config, executor=FakeExecutor())  # handed one: tests and tools, many engines a process
    try:
        assert gc.get_freeze_count() == 0
    finally:
        e.close()


def test_a_collector_pause_is_a_gc_host_phase_of_the_step_it_stalled():
    e = engine()
    try:
        e.add_request("r", [1, 2, 3], GREEDY)
        e.step()
        garbage = [[i] for i in range(300_000)]  # collectable objects enough for a pass of milliseconds
        for a, b in zip(garbage, garbage[1:], strict=False):
            a.append(b)
        del garbage, a, b
        gc.collect()
        e.step()
        phases = [p for p in e.executor.host_phases if p.name == "gc"]  # type: ignore[attr-defined]
        assert phases and all(p.end - p.start >= 1e-3 for p in phases)
        assert phases[-1].step == 0  # between steps: the step timed last, handed over by the next step()
    finally:
        e.close()
    assert gc.callbacks.count(e._phases._gc._callback) == 0  # the watch is gone with the engine


def test_the_watch_reports_each_pass_with_its_span_and_stops_when_closed():
    seen: list[tuple[float, float]] = []
    watch = GcWatch(lambda start, end: seen.append((start, end)), min_pause_s=0.0)
    gc.disable()  # only the passes made below: none started by allocations meanwhile
    try:
        for _ in range(3):
            gc.collect()
        assert len(seen) == 3 and all(start <= end for start, end in seen)  # each pass, with its span
        watch.close()
        gc.collect()
        assert len(seen) == 3
    finally:
        gc.enable()


def test_the_watch_leaves_out_passes_shorter_than_its_threshold():
    seen: list[tuple[float, float]] = []
    watch = GcWatch(lambda start, end: seen.append((start, end)), min_pause_s=60.0)
    try:
        gc.collect()
        assert seen == []
    finally:
        watch.close()
