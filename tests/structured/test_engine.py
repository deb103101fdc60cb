"""Constrained decoding in the engine on the tiny model: outputs obey their constraint, a constrained
row beside free rows is what it is alone, no program compiles for a new grammar or a new mix, async
scheduling and stage processes agree, a grammar that fails its compile fails its request only."""

from __future__ import annotations

import json
import threading
import time

import pytest

from jaxcpp import SamplingParams
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.structured import grammar as grammar_module
from jaxcpp.structured.constraint import StructuredOutputs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "temperature": 0.0, **kwargs})


def test_constrained_rows_obey_and_match_their_runs_alone(small_llm) -> None:
    llm = small_llm()
    schema, choice = StructuredOutputs.from_schema(SCHEMA), StructuredOutputs(choice=("alpha", "beta"))
    params = [constrained(structured_outputs=schema), SamplingParams(max_tokens=12, temperature=0.0),
              constrained(structured_outputs=StructuredOutputs(regex=r"[a-c]{2,4}-[0-9]{2}")),
              constrained(structured_outputs=choice), SamplingParams(max_tokens=12, temperature=0.0)]
    prompts = ["Tell me", "Once upon", "Code:", "Pick one", "Hello"]
    before = llm.engine.stats().num_compilations_since_warmup
    batch = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    value = json.loads(batch[0].text)
    assert set(value) == {"name", "n", "tags"} and 0 <= value["n"] <= 99 and 1 <= len(value["tags"]) <= 3
    assert batch[2].text[-3] == "-" and batch[3].text in ("alpha", "beta")
    assert all(o.finish_reason == "stop" for o in (batch[0], batch[2], batch[3]))
    free = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert free.token_ids == batch[4].token_ids  # a free row beside constrained ones is untouched
    assert llm.engine.stats().num_compilations_since_warmup == before == 0


def test_sampled_json_always_parses_with_penalties_top_k_and_n(small_llm) -> None:
    llm = small_llm()
    so = StructuredOutputs.from_schema(SCHEMA)
    params = SamplingParams(max_tokens=96, temperature=1.0, top_k=40, top_p=0.95, n=6, seed=3,
                            repetition_penalty=1.2, structured_outputs=so, logprobs=2)
    out = llm.generate(["Data"], params)[0]
    assert len(out.samples) == 6
    for sample in out.samples:
        value = json.loads(sample.text)
        assert set(value) == {"name", "n", "tags"} and len(value["name"]) <= 5
        assert len(sample.logprobs) == len(sample.token_ids)
    assert len({s.text for s in out.samples}) > 1  # temperature 1: really sampled
    assert llm.engine.stats().num_compilations_since_warmup == 0


def test_stop_strings_and_max_tokens_still_cut_a_constrained_stream(small_llm) -> None:
    llm = small_llm()
    so = StructuredOutputs(regex="ab(cd)+")
    cut = llm.generate(["x"], SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=so))[0]
    assert cut.text == "abcd" and cut.finish_reason == "length"
    stopped = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=1.0, seed=0, stop=("dc",),
                                                 structured_outputs=so))[0]
    assert stopped.text == "abc" and stopped.finish_reason == "stop"


def test_async_scheduling_gives_the_same_tokens(small_llm) -> None:
    prompts = ["Tell me", "Once upon", "Pick"]
    params = [constrained(structured_outputs=StructuredOutputs.from_schema(SCHEMA)),
              SamplingParams(max_tokens=30, temperature=0.0),
              constrained(temperature=1.0, seed=5, structured_outputs=StructuredOutputs(json_object=True),
                          max_tokens=40)]
    sync = small_llm(async_scheduling=False).generate(prompts, params)
    fast = small_llm(async_scheduling=True).generate(prompts, params)
    assert [o.token_ids for o in sync] == [o.token_ids for o in fast]


@pytest.mark.slow
def test_stage_processes_give_the_same_tokens(small_llm) -> None:
    prompts = ["Tell me", "Once upon"]
    params = [constrained(structured_outputs=StructuredOutputs.from_schema(SCHEMA)),
              SamplingParams(max_tokens=20, temperature=0.0)]
    one = small_llm().generate(prompts, params)
    mp = small_llm(pipeline_parallel_size=2, distributed_executor_backend="mp").generate(prompts, params)
    assert [o.token_ids for o in mp] == [o.token_ids for o in one]
    json.loads(mp[0].text)


# ---- the grammar pool, on the fake executor (no jax) -------------------------------------------------
def fake_llm():
    from jaxcpp import LLM

    return LLM(executor=FakeExecutor(vocab_size=259, eos_token_id=257), max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8, log_stats_interval_s=0)


def test_a_request_waits_for_its_own_grammar_only(monkeypatch) -> None:
    release = threading.Event()
    build = grammar_module.GrammarCompiler._build

    def slow_build(self, constraint):
        if constraint.regex == "slow":
            release.wait(10)
        return build(self, constraint)

    monkeypatch.setattr(grammar_module.GrammarCompiler, "_build", slow_build)
    llm = fake_llm()
    engine = llm.engine
    engine.add_request("slow", "hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="slow")))
    engine.add_request("fast", "hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="ok")))
    engine.add_request("free", "hi", SamplingParams(max_tokens=3))
    done: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.finish_reason
        if {"fast", "free"} <= done.keys():
            break
    assert done == {"fast": "stop", "free": "length"}  # the slow grammar held up no one else
    assert engine.scheduler.requests["slow"].pages == []  # still waiting: no page taken
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.finish_reason if out.finished else None
    assert done["slow"] == "stop"
    llm.engine.close()


def test_a_grammar_that_fails_to_build_fails_its_request_only(monkeypatch) -> None:
    def failing_build(self, constraint):
        raise grammar_module.InvalidRequestError("structured_outputs.regex", "cannot be compiled: boom")

    monkeypatch.setattr(grammar_module.GrammarCompiler, "_build", failing_build)
    llm = fake_llm()
    engine = llm.engine
    engine.add_request("bad", "hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="a")))
    engine.add_request("free", "hi", SamplingParams(max_tokens=3))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["bad"].finish_reason == "error" and "structured_outputs.regex" in outs["bad"].error
    assert outs["free"].finish_reason == "length"
    assert engine.allocator.num_used == 0
    llm.engine.close()
