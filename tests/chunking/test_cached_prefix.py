"""Dynamic chunking with a cached prefix: the prefix is the starting L of the latency model. The
controller gets `num_computed_tokens` (cached prefix included), so equal-latency sizes from L, optimal
plans from `start = L` (and so predicts TTFT from there), and calibration still counts a cache hit
as a newly admitted prompt. Also end to end: the real engine and scheduler on a fake executor."""

from types import SimpleNamespace

from jaxcpp.chunking.controller import DynamicChunkController
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import predicted_ttft
from jaxcpp.chunking.optimal import plan_optimal
from jaxcpp.chunking.planner import ChunkSettings, equal_latency_chunk, plan_fixed
from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.sampling_params import SamplingParams

A = 2.9e-10
TRUE = LatencyModel(a=A, b=18500 * A, c=0.005, gamma=1630 * A)
SETTINGS = ChunkSettings(budget=32768, smooth_factor=0.75, min_chunk_size=4096, pipeline_parallel_size=4)
PROMPT, CACHED = 131072, 65536


def admitted(request_id: str, prompt_len: int, cached: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, num_computed_tokens=cached, num_remaining=prompt_len - cached,
                           admission_prefix=cached)


def prefill(ctl: DynamicChunkController, seq: SimpleNamespace) -> list[int]:
    chunks = []
    while seq.num_remaining:
        ctl.observe_step(1)
        chunk = ctl.prefill_chunk(seq, SETTINGS.budget)
        ctl.record_timing(chunk, seq.num_computed_tokens, float(TRUE.predict(seq.num_computed_tokens, chunk)),
                          True, seq.request_id)
        chunks.append(chunk)
        seq.num_computed_tokens += chunk
        seq.num_remaining -= chunk
    ctl.finish_request(seq.request_id)
    return chunks


def test_equal_latency_sizes_the_first_chunk_from_the_cached_prefix():
    ctl = DynamicChunkController(SETTINGS, model=TRUE)
    chunks = prefill(ctl, admitted("r", PROMPT, CACHED))
    assert chunks[0] == equal_latency_chunk(TRUE, CACHED, SETTINGS.budget, SETTINGS).size < SETTINGS.budget
    assert sum(chunks) == PROMPT - CACHED
    assert prefill(ctl, admitted("fresh", PROMPT, 0))[0] == SETTINGS.budget  # at L = 0 the base itself


def test_optimal_plans_and_predicts_from_the_cached_prefix():
    ctl = DynamicChunkController(SETTINGS, policy="optimal", model=TRUE)
    chunks = prefill(ctl, admitted("r", PROMPT, CACHED))
    assert chunks == plan_optimal(TRUE, PROMPT, SETTINGS, start=CACHED)
    ttft = predicted_ttft(TRUE, chunks, 4, start=CACHED)
    assert ttft <= predicted_ttft(TRUE, plan_fixed(PROMPT, SETTINGS.budget, CACHED), 4, start=CACHED)
    # Planning the rest as if it were a fresh prompt would predict a different (too short) TTFT.
    assert predicted_ttft(TRUE, chunks, 4) < ttft


def test_calibration_counts_a_cache_hit_as_a_newly_admitted_prompt():
    ctl = DynamicChunkController(SETTINGS)
    ctl.set_startup_fit(TRUE.b, TRUE.c)
    assert prefill(ctl, admitted("r0", PROMPT, CACHED)) == [32768] * 2
    assert prefill(ctl, admitted("r1", PROMPT, CACHED)) == [8192] * 8  # the alternation goes on


def test_the_engine_sizes_a_cached_request_from_its_prefix():
    flags = dict(model="tiny", max_model_len=2048, max_num_batched_tokens=512, pipeline_parallel_size=2,
                 num_pages=300, log_stats_interval_s=0, enable_dynamic_chunking=True,
                 dynamic_chunking_min_chunk_size=64, dynamic_chunking_smooth_factor=1.0)
    fake = FakeExecutor(num_stages=2)
    engine = LLMEngine(EngineConfig.from_kwargs(**flags), executor=fake)
    model = LatencyModel(a=1e-7, b=1e-4, c=1e-3, gamma=0.0)
    engine.chunking.install(model)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [(7 * j) % 250 + 1 for j in range(1100)]
    for request_id, p in (("a", prompt), ("b", prompt[:1024] + [9] * 200)):
        steps_before = len(fake.steps)
        engine.add_request(request_id, p, params)
        while engine.has_unfinished_requests():
            engine.step()
    first_b = fake.steps[steps_before]
    assert int(first_b.kv_lens[0]) - int(first_b.cu_q_lens[1]) == 1024  # b starts after its cached prefix
    expected = equal_latency_chunk(model, 1024, 512, engine.chunking.settings).size
    assert int(first_b.cu_q_lens[1]) == expected < 512
    assert engine.stats().num_prefix_cache_hit_tokens_total == 1024
