"""The plain sampler draws a step's rows alone (rounded up to a power of two), not max_num_seqs rows: a
lone stream's draw costs one row's noise. Each request's tokens are what they are in any batch, and no
step compiles anything after warm-up (every row rung is compiled at start-up)."""

from __future__ import annotations

from typing import Any

from jaxcpp.runtime import compile_guard
from jaxcpp.sampling_params import SamplingParams


def spy_on_rows(llm: Any) -> list[int | None]:
    """The `rows` (its fourth argument) of every call of the last stage's sampler, from now on."""
    stage, calls = llm.engine.executor.stages[-1], []
    sampler = stage._sampler

    def spy(*args: Any) -> Any:
        calls.append(args[3] if len(args) > 3 else None)
        return sampler(*args)

    stage._sampler = spy
    return calls


def test_a_lone_stream_draws_one_row_and_a_batch_its_rows_with_the_tokens_of_any_batch(make_llm):
    llm = make_llm(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    rows = spy_on_rows(llm)
    sampled = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9 if i % 2 else 1.0, seed=i, ignore_eos=True)
               for i in range(3)]
    prompts = ["def f(x):", "import os\n", "class A:"]
    with compile_guard.forbid_compile():
        alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, sampled, strict=True)]
        assert set(rows) == {1}  # a lone stream: one row, whatever max_num_seqs
        rows.clear()
        together = [out.token_ids for out in llm.generate(prompts, sampled)]
    assert 4 in rows and set(rows) <= {1, 2, 4}  # three streams: the next power of two (fewer as they start)
    assert together == alone
    assert llm.engine.stats().num_compilations_since_warmup == 0
    llm.close()
