"""The grammar pool in the engine, on the fake executor (host only, no jax): a constrained request waits
for its own grammar only, holding no page meanwhile; one whose grammar fails to build fails alone."""

from __future__ import annotations

import threading
import time

from jaxcpp import SamplingParams
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.structured import grammar as grammar_module
from jaxcpp.structured.constraint import StructuredOutputs


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
