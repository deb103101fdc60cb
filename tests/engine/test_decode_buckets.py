"""Steps of few tokens take the short ladder below 64 (decodes, and prompt chunks that score no prompt
token); a step that scores prompt tokens keeps the multiples of max(64, page size). Host only (fake
executor), milliseconds, but for one test on the real tiny model: the rungs change no token."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcpp.core import sizing
from jaxcpp.core.buckets import DECODE_LADDER, decode_buckets, padding_share, step_bucket, token_buckets
from jaxcpp.runtime import compile_guard
from jaxcpp.sampling_params import SamplingParams
from tests.engine.test_engine_fake import engine, prompts, run


def test_the_ladder_stops_below_the_alignment_and_at_the_most_sequences_a_step_decodes():
    assert decode_buckets(64, 16) == list(DECODE_LADDER) == [8, 16, 32]
    assert decode_buckets(256, 16) == [8, 16, 32]
    assert decode_buckets(12, 16) == [8, 16]   # 16 holds the 12 decodes a step may have
    assert decode_buckets(8, 16) == [8]
    assert decode_buckets(1, 16) == [8]
    for max_num_seqs in (1, 5, 8, 9, 31, 32, 64, 512):
        for page_size in (16, 64, 128):
            rungs = decode_buckets(max_num_seqs, page_size)
            assert rungs == sorted(rungs) and all(r < max(64, page_size) for r in rungs)
            assert rungs[-1] >= min(max_num_seqs, DECODE_LADDER[-1])


def test_only_a_decode_only_step_takes_a_rung_below_the_token_buckets():
    buckets, rungs = token_buckets(512, 16), decode_buckets(64, 16)
    assert [step_bucket(n, True, buckets, rungs) for n in (1, 8, 9, 17, 32, 33, 64)] == [8, 8, 16, 32, 32, 64, 64]
    assert [step_bucket(n, False, buckets, rungs) for n in (1, 8, 33, 64, 65)] == [64, 64, 64, 64, 128]


def test_padding_share_prices_decode_only_steps_on_the_rungs():
    steps, decode_only = [64, 5, 5, 100], [False, True, False, False]
    assert padding_share(steps, [64, 128]) == pytest.approx((59 + 59 + 28) / 320)
    share = padding_share(steps, [64, 128], on_rungs=decode_only, decode_rungs=[8, 16, 32])
    assert share == pytest.approx((3 + 59 + 28) / (64 + 8 + 64 + 128))


def test_the_engine_runs_decode_only_steps_in_the_rungs_and_compiles_nothing_after_warm_up():
    e = engine(max_num_batched_tokens=64, max_num_seqs=16)
    assert e.sizing.shape.buckets == [8, 16, 64]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    done = run(e, {**prompts(12, 5), "long": [5] * 90}, params)  # 12 decodes beside the long one's chunks
    done.update(run(e, {f"b{i}": [9, i + 1, 4] for i in range(3)}, params))  # then 3 decodes
    assert len(done) == 16 and all(len(tokens) == 8 for tokens in done.values())
    steps = e.executor.steps  # type: ignore[attr-defined]
    decode_only = [s for s in steps if int(s.num_decodes) == int(s.num_seqs)]
    with_chunks = [s for s in steps if int(s.num_decodes) < int(s.num_seqs)]
    assert {s.num_tokens_padded for s in decode_only} == {8, 16}
    assert with_chunks and {s.num_tokens_padded for s in with_chunks if int(s.cu_q_lens[-1]) > 32} == {64}
    assert {s.num_tokens_padded for s in with_chunks if int(s.cu_q_lens[-1]) <= 16} == {16}  # the 3 short prompts
    assert all(int(s.cu_q_lens[-1]) <= s.num_tokens_padded for s in steps)
    assert e.stats().num_compilations_since_warmup == 0


def test_a_short_prompt_takes_a_rung_unless_its_prompt_tokens_are_scored():
    e = engine(max_num_batched_tokens=64, max_num_seqs=16)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(e, {"short": [5, 6, 7, 8, 9]}, plain)
    run(e, {"scored": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=1))
    steps = e.executor.steps  # type: ignore[attr-defined]
    prefills = [s for s in steps if int(s.num_decodes) < int(s.num_seqs)]
    assert [(int(s.cu_q_lens[-1]), s.num_tokens_padded) for s in prefills] == [(5, 8), (5, 64)]
    assert e.stats().num_compilations_since_warmup == 0


@pytest.mark.slow  # two engines on the tiny model
def test_on_the_real_model_the_rungs_give_the_tokens_and_logits_of_the_64_bucket(make_llm, monkeypatch):
    flags = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=16)
    prompts_ = ["def f(x):", "import os\n", "class A:", "# note"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    laddered = make_llm(**flags)
    assert laddered.engine.sizing.shape.buckets == [8, 16, 64]
    with compile_guard.forbid_compile():  # the rungs were compiled at start-up like every bucket
        with_rungs = laddered.generate(prompts_, params)
        padded: list[int] = []
        submit = laddered.engine.executor.submit
        laddered.engine.executor.submit = lambda r: (padded.append(r.step.num_tokens_padded), submit(r))[1]
        with_rungs += laddered.generate(prompts_[:1], params)  # a lone short prompt: its prefill on a rung
        assert padded[0] == 16 and set(padded[1:]) == {8}
    assert laddered.engine.stats().num_compilations_since_warmup == 0
    laddered.close()
    monkeypatch.setattr(sizing, "decode_buckets", lambda *_: [])
    plain = make_llm(**flags)
    assert plain.engine.sizing.shape.buckets == [64]
    without = plain.generate(prompts_, params) + plain.generate(prompts_[:1], params)
    plain.close()
    for a, b in zip(with_rungs, without, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=0, atol=1e-5)
