"""Constrained decoding in the engine on the tiny model: outputs obey their constraint, a constrained
row beside free rows is what it is alone, no program compiles for a new grammar or a new mix, async
scheduling and stage processes agree (the grammar pool on the fake executor: test_grammar_pool.py)."""

from __future__ import annotations

import json

import pytest

from jaxcpp import SamplingParams
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


def test_async_scheduling_keeps_a_constrained_stream_a_step_ahead(small_llm, monkeypatch) -> None:
    """In process, a constrained decode is scheduled before its previous token is back: the step's
    forward runs while the host collects that token, and its draw follows with the mask filled then."""
    llm = small_llm(async_scheduling=True)
    executor, late = llm.engine.executor, []
    sample = executor.sample
    monkeypatch.setattr(executor, "sample", lambda step_id, bitmask: (late.append(step_id), sample(step_id, bitmask)))
    out = llm.generate(["Tell me"], constrained(structured_outputs=StructuredOutputs.from_schema(SCHEMA)))[0]
    jsonschema_ok = json.loads(out.text)
    assert jsonschema_ok and len(late) >= len(out.token_ids) - 2  # every decode but the first drawn late
    assert llm.engine.stats().num_compilations_since_warmup == 0


def test_a_late_draw_sends_its_mask_with_the_sampler_call(small_llm, monkeypatch) -> None:
    """A late draw is the sampler program's dispatch alone: the mask goes with its call, not through a
    device_put of its own (which cost the draw more host time than the dispatch: docs/benchmarks.md)."""
    import jax

    llm = small_llm(async_scheduling=True)
    executor, put = llm.engine.executor, jax.device_put
    sample, drawing, draws, puts_in_draws = executor.sample, [], [], []

    def draw(step_id, bitmask):
        drawing.append(step_id)
        draws.append(step_id)
        try:
            return sample(step_id, bitmask)
        finally:
            drawing.pop()

    def counted_put(*args, **kwargs):
        if drawing:
            puts_in_draws.append(drawing[-1])
        return put(*args, **kwargs)

    monkeypatch.setattr(executor, "sample", draw)
    monkeypatch.setattr(jax, "device_put", counted_put)
    out = llm.generate(["Tell me"], constrained(structured_outputs=StructuredOutputs.from_schema(SCHEMA)))[0]
    assert json.loads(out.text) and len(draws) >= len(out.token_ids) - 2
    assert puts_in_draws == []
    assert llm.engine.stats().num_compilations_since_warmup == 0


@pytest.mark.slow
@pytest.mark.parametrize("stages", [dict(pipeline_parallel_size=2),  # in process: draws deferred
                                    dict(pipeline_parallel_size=2, distributed_executor_backend="mp")],
                         ids=["pp2", "pp2-stage-processes"])
def test_pipeline_stages_give_the_same_tokens(small_llm, stages) -> None:
    prompts = ["Tell me", "Once upon", "Pick"]
    params = [constrained(structured_outputs=StructuredOutputs.from_schema(SCHEMA)),
              SamplingParams(max_tokens=20, temperature=0.0),
              constrained(temperature=1.0, seed=2, structured_outputs=StructuredOutputs(regex="[a-z]{3,9}!"))]
    one = small_llm().generate(prompts, params)
    llm = small_llm(**stages)
    piped = llm.generate(prompts, params)
    assert [o.token_ids for o in piped] == [o.token_ids for o in one]
    json.loads(piped[0].text)
    assert llm.engine.stats().num_compilations_since_warmup == 0
