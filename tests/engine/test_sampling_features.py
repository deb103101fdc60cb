"""The sampling features every front end shares, on the real engine with the fake executor (no jax):
validation that names the field, stop strings at the edge, n samples sharing one prefill, logprobs
carried to the outputs, requests with a device history kept off the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp import LLM, SamplingParams
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.outputs import RequestMetrics, RequestOutput
from jaxcpp.errors import InvalidRequestError
from jaxcpp.output_processor import SampleStream, fan_out
from jaxcpp.tokenizer import ByteTokenizer

FLAGS = dict(model="tiny", max_model_len=256, page_size=16, num_pages=64, max_num_batched_tokens=64,
             max_num_seqs=8, log_stats_interval_s=0)
PROMPT = [ord(c) for c in "def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"]  # 57 tokens


def fake_llm(**flags: object) -> LLM:
    return LLM(executor=FakeExecutor(eos_token_id=257), **{**FLAGS, **flags})


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(n=0), "n"), (dict(n=129), "n"), (dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=("",)), "stop"), (dict(stop=tuple("abcdefghijklmnopq")), "stop"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_bad_values_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_n_samples_have_their_own_seeds_and_ids() -> None:
    samples = fan_out("r", SamplingParams(n=3, seed=7))
    assert [(rid, p.n, p.seed) for rid, p in samples] == [("r#0", 1, 7), ("r#1", 1, 8), ("r#2", 1, 9)]
    assert fan_out("r", SamplingParams()) == [("r", SamplingParams())]


def output(new: list[int], all_ids: list[int], finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [1], all_ids, new, finished, reason, RequestMetrics(0.0))


def feed(stream: SampleStream, text: str) -> list[str]:
    ids: list[int] = []
    deltas = []
    for i, byte in enumerate(text.encode()):
        ids.append(byte)
        delta = stream.process(output([byte], list(ids), finished=i == len(text) - 1, reason="length"))
        if delta is None:
            break
        deltas.append(delta.text)
        if delta.finished:
            break
    return deltas


def test_a_stop_string_across_tokens_ends_the_text_before_it_and_is_never_streamed() -> None:
    stream = SampleStream(0, SamplingParams(stop=("fib", "zz")), ByteTokenizer())
    deltas = feed(stream, "def fibonacci")
    assert "".join(deltas) == stream.text == "def "
    assert (stream.finish_reason, stream.stop_reason) == ("stop", "fib")
    assert deltas[:4] == ["", "", "d", "e"]  # len("fib") - 1 characters held back while they could begin it
    assert stream.token_ids == list(b"def fib")  # the token that completed the stop is the last


def test_include_stop_str_in_output_and_min_tokens() -> None:
    stream = SampleStream(0, SamplingParams(stop=("ab",), include_stop_str_in_output=True), ByteTokenizer())
    assert "".join(feed(stream, "xxabyy")) == "xxab"
    late = SampleStream(0, SamplingParams(stop=("ab",), min_tokens=4, max_tokens=10), ByteTokenizer())
    assert "".join(feed(late, "abxabyy")) == "abx"  # the first "ab" came before min_tokens
    assert late.stop_reason == "ab"


def test_offline_stop_strings_abort_the_engine_request_and_free_its_pages() -> None:
    with fake_llm() as llm:
        plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=40))[0]
        stop = plain.text[10:12]
        out = llm.generate(prompt_token_ids=[PROMPT],
                           sampling_params=SamplingParams(max_tokens=40, stop=(stop,)))[0]
        cut = plain.text.index(stop)
        assert out.text == plain.text[:cut] and out.finish_reason == "stop"
        assert out.token_ids == plain.token_ids[:len(out.token_ids)] and len(out.token_ids) <= cut + 2
        assert llm.engine.allocator.num_used == 0 and not llm.engine.has_unfinished_requests()


def test_n_samples_share_one_prefill_through_the_prefix_cache() -> None:
    with fake_llm() as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(n=3, max_tokens=4))[0]
        assert out.samples is not None and len(out.samples) == 3
        full_pages = (len(PROMPT) - 1) // 16 * 16
        assert [s.num_cached_tokens for s in out.samples] == [0, full_pages, full_pages]
        assert llm.engine.stats().num_prompt_tokens_total == len(PROMPT) + 2 * (len(PROMPT) - full_pages)


def test_logprobs_reach_the_outputs_and_history_requests_skip_the_prefix_cache() -> None:
    with fake_llm() as llm:
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2))  # cache it
        params = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1, repetition_penalty=1.2)
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert out.num_cached_tokens == 0  # every prompt token passes the device (penalties, prompt logprobs)
    assert [e.token_id for e in out.logprobs or []] == out.token_ids
    assert all(len(e.top) == 2 and e.top[0][0] == e.token_id for e in out.logprobs or [])
    assert [e.token_id for e in out.prompt_logprobs or []] == PROMPT[1:]
    predicted = [FakeExecutor().next_token(t, p, 0) for p, t in enumerate(PROMPT[:-1])]
    assert [e.top[0][0] for e in out.prompt_logprobs or []] == predicted


def test_min_tokens_bans_the_stop_ids_on_the_device_input() -> None:
    with fake_llm() as llm:
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=3, min_tokens=2,
                                                                                stop_token_ids=(5,)))
        banned = [step.banned_ids[0].tolist() for step in llm.engine.executor.steps]  # type: ignore[attr-defined]
    assert [b[:2] for b in banned if b[0] != -1] == [[257, 5], [257, 5]]  # before tokens 1 and 2, not 3


def test_history_slots_are_given_and_taken_back() -> None:
    with fake_llm() as llm:
        params = SamplingParams(max_tokens=4, presence_penalty=0.5)
        llm.generate(prompt_token_ids=[PROMPT, PROMPT[:20]], sampling_params=params)
        steps = llm.engine.executor.steps  # type: ignore[attr-defined]
        first = steps[0]
        assert int(first.clear_slot[0]) >= 0 and int(first.clear_slot[0]) != int(first.clear_slot[1])
        assert np.count_nonzero(first.prompt_slot >= 0) == int(first.cu_q_lens[2])  # both chunks' prompt tokens
        assert len(llm.engine.scheduler.free_history_slots) == FLAGS["max_num_seqs"]


def test_prompt_logprobs_ride_on_the_first_and_the_finished_output_only() -> None:
    """Outputs carry what is new: the prompt's log-probabilities (all scored once the first token is)
    come with the first output and the finished one, not with every output in between; LLM's final
    output has them even when a stop string ends the sample before the engine does."""
    with fake_llm() as llm:
        llm.engine.add_request("r", PROMPT, SamplingParams(max_tokens=5, prompt_logprobs=1, ignore_eos=True))
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += [o for o in llm.engine.step() if o.request_id == "r"]
        assert len(outputs) == 5 and outputs[-1].finished
        carried = [o.prompt_logprobs is not None for o in outputs]
        assert carried == [True, False, False, False, True]
        assert [e.token_id for e in outputs[0].prompt_logprobs or []] == PROMPT[1:]
        assert outputs[0].prompt_logprobs == outputs[-1].prompt_logprobs
        stop = llm.engine.tokenizer.decode(outputs[-1].token_ids[1:3])
        params = SamplingParams(max_tokens=5, prompt_logprobs=1, ignore_eos=True, stop=(stop,))
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert out.finish_reason == "stop" and [e.token_id for e in out.prompt_logprobs or []] == PROMPT[1:]
