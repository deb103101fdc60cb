"""The equal-latency solver (ATOM's rule) and the fixed plans, against DYNAMIC_CHUNKING.md."""

import pytest

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.planner import (
    ChunkSettings,
    equal_latency_chunk,
    plan_fixed,
    prefix_floor,
    raw_equal_latency_chunk,
    snap_down,
)
from jaxcpp.chunking.policy import next_chunk_size, plan_chunks

CONFORMANCE_MODEL = LatencyModel(a=1.0, b=18500.0, c=0.0, gamma=1630.0)
CONFORMANCE = ChunkSettings(budget=32768, smooth_factor=1.0, min_chunk_size=4096, page_size=16,
                            pipeline_parallel_size=4)


def test_conformance_sequence_comes_out_exactly():
    chunks = plan_chunks("equal-latency", 131072, CONFORMANCE, CONFORMANCE_MODEL)
    assert chunks == [32768, 16192, 12416, 10368, 9088, 8192, 7488, 6912, 6464, 6080, 5760, 5504, 3840]


def test_c_cancels_in_the_solver():
    # c shifts every chunk's time equally, so only the prefix floor could see it; here it does not bind.
    with_c = LatencyModel(a=1.0, b=18500.0, c=1e6, gamma=1630.0)
    assert plan_chunks("equal-latency", 131072, CONFORMANCE, with_c) == \
        plan_chunks("equal-latency", 131072, CONFORMANCE, CONFORMANCE_MODEL)


def test_smoothing_zero_equals_fixed_chunking():
    settings = ChunkSettings(budget=32768, smooth_factor=0.0, min_chunk_size=4096)
    assert plan_chunks("equal-latency", 200_000, settings, CONFORMANCE_MODEL) == plan_fixed(200_000, 32768)


def test_unreachable_equal_latency_keeps_the_fixed_chunk():
    # γ·L above the first chunk's whole a·base² + b·base: no chunk can take as long as the first.
    m = LatencyModel(a=1.0, b=10.0, c=0.0, gamma=1e6)
    choice = equal_latency_chunk(m, 40_000, 20_000, CONFORMANCE)
    assert (choice.size, choice.source) == (20_000, "unreachable")


def test_alignment_that_leaves_less_than_the_alignment_keeps_the_fixed_chunk():
    settings = ChunkSettings(budget=512, smooth_factor=1.0, min_chunk_size=1, allowed_sizes=(256, 512))
    m = LatencyModel(a=1.0, b=1.0, c=0.0, gamma=0.0)
    # Far into a prompt the raw chunk is tiny; min chunk 1 lets it through, no bucket is below it.
    assert equal_latency_chunk(m, 1_000_000, 512, settings).source == "unreachable"
    assert equal_latency_chunk(m, 1_000_000, 300, settings).size == 300


def test_min_chunk_floor_holds():
    settings = ChunkSettings(budget=32768, smooth_factor=1.0, min_chunk_size=8192)
    chunks = plan_chunks("equal-latency", 400_000, settings, CONFORMANCE_MODEL)
    assert min(chunks[:-1]) == 8192  # the solver would go lower without the floor
    assert all(x % 64 == 0 for x in chunks[:-1])


def test_budget_cap_holds():
    # What is left of the step's budget caps the chunk, and the result still snaps to the alignment.
    choice = equal_latency_chunk(CONFORMANCE_MODEL, 32768, 9000, CONFORMANCE)
    assert choice.size == 8960 and choice.source == "model"
    assert next_chunk_size("equal-latency", CONFORMANCE_MODEL, 131072, 0, 1000, CONFORMANCE) == 960


def test_prefix_floor_keeps_gamma_under_a_fifth_of_the_chunk():
    L = 400_000
    floor = prefix_floor(CONFORMANCE_MODEL, L)
    assert CONFORMANCE_MODEL.gamma * L == pytest.approx(0.2 * CONFORMANCE_MODEL.predict(L, floor), rel=1e-9)
    settings = ChunkSettings(budget=32768, smooth_factor=1.0, min_chunk_size=64)
    raw = raw_equal_latency_chunk(CONFORMANCE_MODEL, L, 32768)
    assert raw < floor < 32768  # the floor binds here
    assert equal_latency_chunk(CONFORMANCE_MODEL, L, 32768, settings).size == int(floor) // 64 * 64


def test_allowed_sizes_snap_down_to_the_largest_bucket_not_above():
    settings = ChunkSettings(budget=32768, smooth_factor=1.0, min_chunk_size=4096,
                             allowed_sizes=(4096, 8192, 12288, 16384, 24576, 32768))
    assert snap_down(16191, settings) == 12288
    assert snap_down(100, settings) == 0
    chunks = plan_chunks("equal-latency", 131072, settings, CONFORMANCE_MODEL)
    assert set(chunks[:-1]) <= set(settings.allowed_sizes)
    assert chunks[:3] == [32768, 12288, 12288]


def test_alignment_is_max_of_page_size_and_64():
    assert ChunkSettings(budget=512, page_size=16).alignment == 64
    assert ChunkSettings(budget=512, page_size=256).alignment == 256


def test_fixed_policy_and_no_model_give_fixed_chunks():
    assert plan_chunks("fixed", 70_000, CONFORMANCE, CONFORMANCE_MODEL) == [32768, 32768, 4464]
    assert plan_chunks("equal-latency", 70_000, CONFORMANCE, None) == [32768, 32768, 4464]
    with pytest.raises(ValueError, match="unknown chunking policy"):
        next_chunk_size("greedy", CONFORMANCE_MODEL, 10, 0, 10, CONFORMANCE)
