"""The pipeline executor's contract: micro-batches in flight, FIFO collects that only wait when asked,
timing probes, the trace, the lazily compiled attention-free forwards."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from jaxcpp import SamplingParams
from jaxcpp.core.executor import StepRequest
from jaxcpp.core.step_input import padding_step
from jaxcpp.runtime import compile_guard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def executor(make_pp_llm, random_model):
    """A fresh 2-stage engine's executor (fresh: the attention-free-forward test compiles into it)."""
    llm = make_pp_llm(model=random_model, pipeline_parallel_size=2)
    yield llm.engine.executor
    llm.engine.executor.close()


STEP_IDS = itertools.count(10_000)  # steps submitted here, past any the (idle) engine ran


def a_step(executor, num_tokens: int = 64):
    return padding_step(num_tokens, executor._shape)


def submit(executor, step, **flags) -> int:
    step_id = next(STEP_IDS)
    executor.submit(StepRequest(step_id, step, **flags))
    return step_id


def test_collect_returns_only_what_was_asked(executor, monkeypatch):
    """How many steps may be in flight, and in which order they are collected, is the engine's rule
    (`jaxcpp.core.in_flight`), not the executor's: it keeps each step by its id until collected."""
    step = a_step(executor)
    step_ids = [submit(executor, step, want_tokens=False) for _ in range(2 * (executor.max_in_flight + 1))]
    with pytest.raises(KeyError):
        executor.collect(step_ids[-1] + 1)  # never submitted

    def never(step_id):
        raise AssertionError("collect waited for the stages' timings")

    monkeypatch.setattr(executor._timing, "wait_for_ack", never)
    results = [executor.collect(t) for t in step_ids]
    # Nothing was fetched: a step of middle prefill chunks is collected without tokens or timings.
    assert all(r.tokens is None and r.logits is None and r.timings == () for r in results)
    monkeypatch.undo()
    result = executor.collect(submit(executor, step))
    assert isinstance(result.tokens, np.ndarray) and result.tokens.shape == (8,)  # host data only


def test_ack_returns_every_stages_timing_at_collect(executor):
    step_id = submit(executor, a_step(executor), ack=True)
    result = executor.collect(step_id)
    seconds = result.forward_time
    assert seconds is not None and 0 <= seconds < 10
    assert [t.stage for t in result.timings] == [0, 1] and all(t.step_id == step_id for t in result.timings)
    mine = [t for t in executor.timings() if t.step_id == step_id]
    assert [t.stage for t in mine] == [0, 1]
    assert all(t.dispatched <= t.start <= t.done for t in mine)
    assert max(t.forward for t in mine) == seconds
    assert all(t.num_tokens_padded == 64 for t in mine)  # the padded size that ran


def test_timings_reach_the_history_later_without_ack(executor):
    step_id = submit(executor, a_step(executor))
    executor.collect(step_id)
    deadline = time.monotonic() + 30
    while len([t for t in executor.timings() if t.step_id == step_id]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t.stage for t in executor.timings() if t.step_id == step_id] == [0, 1]


def test_attention_free_forward_compiles_lazily_once(executor):
    before = executor.num_compilations()
    first = executor.time_attention_free_forward(64)
    assert executor.num_compilations() > before  # not part of warm-up: compiled on first use
    with compile_guard.forbid_compile():
        again = executor.time_attention_free_forward(64)
    assert first > 0 and again > 0


def test_long_prompt_chunks_overlap_on_different_stages(make_pp_llm, random_model, tmp_path):
    """With 4 stages, chunk k+1 of a long prompt is in stage 0 before chunk k has left the last stage.

    XLA:CPU shares one thread pool between devices, so this shows order, not speed."""
    trace = tmp_path / "trace.json"
    llm = make_pp_llm(model=random_model, pipeline_parallel_size=4, max_model_len=512,
                      max_num_batched_tokens=128, trace_file=str(trace))
    prompt = [int(t) for t in np.random.default_rng(1).integers(2, 128, 500)]
    llm.generate(prompt_token_ids=[prompt],
                 sampling_params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.engine.executor.close()

    events = json.loads(trace.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(names) == [0, 1, 2, 3, 4] and names[3].startswith("stage 3: layers 4-5")
    assert names[4] == "host: engine loop"
    boxes = {(e["args"]["step"], e["tid"]): e for e in events if e.get("cat") == "forward"}
    step_ids = sorted({t for t, _ in boxes})
    assert all((t, s) in boxes for t in step_ids for s in range(4))  # warm-up is not traced
    chunks = [t for t in step_ids if boxes[(t, 0)]["args"]["num_tokens_padded"] == 128]
    assert len(chunks) == 4  # 128 + 128 + 128 + 116 prompt tokens

    def end(e):
        return e["ts"] + e["dur"]

    # The host dispatches chunk k+1 while chunk k is still in the pipe. On a loaded 2-core machine one
    # pair can still happen to run back to back, so ask for the overlap, not for every pair of it.
    overlapping = [(k, k1) for k, k1 in zip(chunks, chunks[1:], strict=False)
                   if boxes[(k1, 0)]["ts"] < end(boxes[(k, 3)])]
    assert overlapping, "no chunk entered stage 0 before the previous one left the last stage"
    for t in step_ids:  # each micro-batch goes through the stages in order
        assert all(boxes[(t, s)]["ts"] >= end(boxes[(t, s - 1)]) - 0.01 for s in range(1, 4))

    # The host row: every step's phases, in the order the loop runs them.
    phases: dict[int, dict[str, dict]] = {}
    for e in events:
        if e.get("cat") == "host":
            assert e["tid"] == 4
            phases.setdefault(e["args"]["step"], {})[e["args"]["phase"]] = e
    submitted = [step for step in phases.values() if "dispatch" in step]
    assert len(submitted) == len(step_ids)
    assert sorted(s for s, step in phases.items() if "dispatch" in step) == step_ids  # one id, both rows
    assert all(list(step) == ["schedule"] for step in phases.values() if "dispatch" not in step)  # empty
    order = ["schedule", "build", "dispatch", "wait", "postprocess"]
    for step in submitted:
        assert [p for p in order if p in step] == order
        assert all(end(step[a]) <= step[b]["ts"] + 0.01 for a, b in zip(order, order[1:], strict=False))
