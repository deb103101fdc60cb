"""Stage processes realize the flow shop the planner assumes, read from the stages' own timings:

- an activation hop starts as soon as the producer's output and the consumer are both ready, whatever
  the producer computes next (each stage pinned to its own core, as the benchmarks run them);
- the first stage runs a lone prompt's chunks back to back, with dynamic chunking off and on.

A random Llama big enough that a 512-token forward takes tens of milliseconds on one core, so that a
hop held back by the producer's next forward (the failure this guards against) stands out of the noise.
"""

from __future__ import annotations

import statistics

import pytest

from jaxcpp import LLM, SamplingParams
from tests.pipeline.conftest import write_random_model

pytestmark = pytest.mark.slow

BUDGET = 512
PROMPT_LEN = 6 * BUDGET


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    return write_random_model(tmp_path_factory.mktemp("wide"), num_layers=4, hidden_size=512,
                              intermediate_size=2048, num_heads=8, max_position_embeddings=PROMPT_LEN + 64)


@pytest.fixture(scope="module")
def pinned_pp2(wide_model):
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXCPP_PIN_STAGE_CORES", "1")
    llm = LLM(model=wide_model, dtype="float32", max_model_len=PROMPT_LEN + 16, max_num_batched_tokens=BUDGET,
              page_size=256,  # buckets 256 and 512 only: two programs to compile per stage
              max_num_seqs=4, pipeline_parallel_size=2, distributed_executor_backend="mp",
              enable_prefix_caching=False, log_stats_interval_s=0)
    mp.undo()  # read once, when the head sets up its stages
    yield llm
    llm.engine.close()


def lone_prefill_probes(llm: LLM, seed: int, num_prompts: int = 1) -> dict[int, dict[int, dict]]:
    """{step id: {stage: probe}} of the prefill (max_tokens 1) of one prompt, or of several sent together."""
    executor = llm.engine.executor
    first = llm.engine.scheduler.num_steps
    prompts = [[((seed + n) * 131 + 7 * i) % 120 + 2 for i in range(PROMPT_LEN)] for n in range(num_prompts)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    by_step: dict[int, dict[int, dict]] = {}
    for p in executor.probes():
        if p["id"] >= first:
            by_step.setdefault(p["id"], {})[p["stage"]] = p
    return dict(sorted(by_step.items()))


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_hop_never_waits_for_the_producers_next_forward(pinned_pp2, num_prompts):
    """Stage 1 starts micro-batch k once stage 0 finished k and stage 1 is free, not when stage 0
    finishes k + 1: the hop's late start, max(producer done, consumer's pull start) -> consumer inputs
    ready, stays under half of the producer's next forward (a hop held back by it is late by all of it).
    Two prompts sent together are the schedule that shows it: the second prompt's first, short chunk
    is done on stage 0 while stage 1 still runs the first prompt's last, long one."""
    lone_prefill_probes(pinned_pp2, seed=1)  # untimed: first use of every path
    probes = lone_prefill_probes(pinned_pp2, seed=2, num_prompts=num_prompts)
    forwards = [m[0]["done"] - m[0]["start"] for m in probes.values()]
    assert len(probes) == num_prompts * PROMPT_LEN // BUDGET and statistics.median(forwards) > 0.03, \
        f"forwards too short to tell a late hop from noise: {forwards}"
    late = [m[1]["inputs_ready"] - max(m[0]["done"], m[1]["pull_start"]) for m in probes.values()]
    bounds = [0.5 * f for f in forwards[1:]] + [0.5 * statistics.median(forwards)]  # the last has no next
    assert all(t < b for t, b in zip(late, bounds, strict=True)), \
        f"hops started late (s): {[round(t, 4) for t in late]}; producer forwards {[round(f, 4) for f in forwards]}"


def test_first_stage_runs_a_lone_prompt_back_to_back(pinned_pp2):
    """Fixed chunks, dynamic chunking off (tests/pipeline/test_stand_in.py checks it calibrating and
    installed): between two chunks the first stage waits less than a quarter of a forward or 20 ms."""
    probes = lone_prefill_probes(pinned_pp2, seed=3)
    first = [m[0] for m in probes.values()]
    gaps = [round(b["start"] - a["done"], 4) for a, b in zip(first, first[1:], strict=False)]
    forward = statistics.median(p["done"] - p["start"] for p in first)
    assert max(gaps) < max(0.25 * forward, 0.02), f"first-stage gaps (s): {gaps}; median forward {forward:.3f} s"
