"""The optimal planner against an exhaustive search, fixed plans and the equal-latency rule."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.makespan import makespan, predicted_ttft, stream_period
from jaxcpp.chunking.optimal import plan_optimal, planner_sizes
from jaxcpp.chunking.planner import ChunkSettings, plan_fixed
from jaxcpp.chunking.policy import plan_chunks


def exhaustive_best(model: LatencyModel, prompt_len: int, s: ChunkSettings) -> float:
    """Brute force over every plan (allowed sizes, remainder last) by a DP per latency cap τ.

    min over τ of [min Σ t_i with every t_i <= τ] + (P − 1)·τ is the exact optimum, because the best
    plan's own max is one of the τ tried and every plan under τ costs at most that bound.
    """
    sizes = [int(v) for v in planner_sizes(s)]
    assert all(x % s.alignment == 0 for x in sizes)  # so only multiples of the alignment are reachable
    moves = {}
    for p in range(0, prompt_len, s.alignment):
        rest = prompt_len - p
        moves[p] = [x for x in sizes if x < rest] + ([rest] if rest <= sizes[-1] else [])
    cost = {(p, x): float(model.predict(float(p), float(x))) for p in moves for x in moves[p]}
    taus = np.unique(list(cost.values()))
    best = {0: np.zeros(len(taus))}
    for p in moves:
        if p in best:
            for x in moves[p]:
                t = cost[(p, x)]
                best[p + x] = np.minimum(best.get(p + x, np.inf), best[p] + np.where(t <= taus, t, np.inf))
    return float((best[prompt_len] + (s.pipeline_parallel_size - 1) * taus).min())


def fixed_ttft_closed_form(model: LatencyModel, prompt_len: int, sizes: np.ndarray, pp: int) -> np.ndarray:
    """TTFT of fixed chunks of each size, from the telescoped sum: K·c + b·N + a·N² + γ·s·K(K−1)/2."""
    s = sizes.astype(np.float64)
    k = np.ceil(prompt_len / s)
    rest = prompt_len - (k - 1) * s
    total = (k * model.c + model.b * prompt_len + model.a * float(prompt_len) ** 2
             + model.gamma * s * k * (k - 1) / 2)
    last_full = np.where(k >= 2, model.predict((k - 2) * s, s), 0.0)
    slowest = np.maximum(last_full, model.predict((k - 1) * s, rest))
    return total + (pp - 1) * slowest


def test_within_one_percent_of_exhaustive_search_on_small_prompts():
    rng = np.random.default_rng(7)
    worst = 0.0
    for _ in range(25):
        model = LatencyModel(a=1.0, b=rng.uniform(50, 3000), c=rng.uniform(0, 3e6), gamma=rng.uniform(0, 400))
        prompt_len = int(rng.integers(300, 2600))
        s = ChunkSettings(budget=int(rng.choice([512, 768, 1024])), min_chunk_size=int(rng.choice([64, 256])),
                          pipeline_parallel_size=int(rng.integers(2, 9)))
        ours = predicted_ttft(model, plan_optimal(model, prompt_len, s), s.pipeline_parallel_size)
        worst = max(worst, ours / exhaustive_best(model, prompt_len, s) - 1.0)
    assert worst <= 0.01


@settings(max_examples=50, deadline=None)
@given(a=st.floats(1e-3, 10.0), b=st.floats(1.0, 1e5), c=st.floats(0.0, 1e9), gamma=st.floats(0.0, 1e4),
       prompt_len=st.integers(1, 200_000), pp=st.integers(2, 8), budget=st.sampled_from([2048, 8192, 32768]),
       min_chunk=st.sampled_from([512, 1024, 4096]))
def test_never_predicts_longer_ttft_than_any_fixed_chunk(a, b, c, gamma, prompt_len, pp, budget, min_chunk):
    model = LatencyModel(a, b, c, gamma)
    s = ChunkSettings(budget=budget, min_chunk_size=min_chunk, pipeline_parallel_size=pp, smooth_factor=0.75)
    plan = plan_optimal(model, prompt_len, s)
    assert sum(plan) == prompt_len and max(plan) <= budget
    assert set(plan[:-1]) <= set(planner_sizes(s).tolist())
    ours = predicted_ttft(model, plan, pp)
    assert ours <= fixed_ttft_closed_form(model, prompt_len, planner_sizes(s), pp).min() * (1 + 1e-9)
    assert ours <= predicted_ttft(model, plan_chunks("equal-latency", prompt_len, s, model), pp) * (1 + 1e-9)


def test_closed_form_matches_the_plans():
    model = LatencyModel(a=1.0, b=18500.0, c=3e7, gamma=1630.0)
    sizes = np.array([4096, 5000, 32768, 131072])
    want = [predicted_ttft(model, plan_fixed(131072, int(x)), 4) for x in sizes]
    np.testing.assert_allclose(fixed_ttft_closed_form(model, 131072, sizes, 4), want, rtol=1e-12)


def test_beats_equal_latency_on_the_conformance_model():
    model = LatencyModel(a=1.0, b=18500.0, c=0.0, gamma=1630.0)
    s = ChunkSettings(budget=32768, smooth_factor=1.0, min_chunk_size=4096, pipeline_parallel_size=4)
    ours = predicted_ttft(model, plan_optimal(model, 131072, s), 4)
    assert ours < predicted_ttft(model, plan_chunks("equal-latency", 131072, s, model), 4)


def test_plans_from_a_cached_prefix_cover_the_rest():
    model = LatencyModel(a=1.0, b=18500.0, c=0.0, gamma=1630.0)
    s = ChunkSettings(budget=32768, min_chunk_size=4096, pipeline_parallel_size=4)
    plan = plan_optimal(model, 131072, s, start=50_000)
    assert sum(plan) == 81072
    assert plan_optimal(model, 100, s, start=100) == []
    assert plan_optimal(model, 3000, s) == [3000]


def test_uneven_stages_use_the_exact_recurrence():
    times = np.array([[3.0, 1.0, 2.0, 0.0]])
    # Equal weights: the recurrence and Σ t + (P − 1)·max t agree.
    assert makespan(times, 3, (1.0, 1.0, 1.0))[0] == makespan(times, 3)[0] == 6.0 + 2 * 3.0
    # Hand-run flow shop with a slow last stage (weights 1, 2): C = [3, 4, 6] then [9, 11, 15].
    assert makespan(times, 2, (1.0, 2.0))[0] == 15.0
    model = LatencyModel(a=1.0, b=18500.0, c=0.0, gamma=1630.0)
    s = ChunkSettings(budget=32768, min_chunk_size=4096, pipeline_parallel_size=4,
                      stage_weights=(15 / 16, 15 / 16, 15 / 16, 1.0))
    ours = predicted_ttft(model, plan_optimal(model, 131072, s), 4, s.stage_weights)
    assert ours <= predicted_ttft(model, plan_fixed(131072, 32768), 4, s.stage_weights)


def test_stream_period_counts_the_wait_for_an_in_flight_slot():
    """Chunks [4, 1] (padded) twice in a row on 2 stages. Unbounded, the second copy holds each stage for
    its 5 s of work. With 2 steps in flight its first chunk waits for the first copy's 4 s chunk to leave
    the last stage (at 8, not 5), so each stage is held 8 s. Hand-run: stage 0 ends copy one at 5 and
    copy two at 13, stage 1 at 9 and 17."""
    times = np.array([[4.0, 1.0, 0.0]])
    assert stream_period(times, 2)[0] == 5.0
    assert stream_period(times, 2, max_in_flight=2)[0] == 8.0
    assert stream_period(times, 2, max_in_flight=4)[0] == 5.0
    # Uneven stages: the busiest stage's span (stage 1 takes twice as long: 10 s a copy).
    assert stream_period(times, 2, (1.0, 2.0))[0] == 10.0


# Fitted on real compute (docs/benchmarks.md, run D: 4096-token prompts, budget 1024, PP 2).
RUN_D = LatencyModel(a=7.23e-8, b=1.04e-4, c=0.0069, gamma=0.0)
SMALL = ChunkSettings(budget=1024, min_chunk_size=128, pipeline_parallel_size=2)


def middle(sizes: list[int]) -> int:
    """The upper middle of some sizes."""
    return sorted(sizes)[len(sizes) // 2]


def test_a_plan_departs_from_fixed_chunks_only_for_a_gain_above_the_margin():
    """Under run D's fit its own plan predicts 2.8% less than the best fixed chunk (192; the plan
    measured 10% behind fixed 256): a gain a fit error of 4% cannot vouch for. Below the margin the plan
    is taken; at or above it the middle one of the fixed chunks predicted within the margin of it."""
    fixed = {int(x): predicted_ttft(RUN_D, plan_fixed(4096, int(x)), 2) for x in planner_sizes(SMALL)}
    planned = plan_optimal(RUN_D, 4096, SMALL)
    best = predicted_ttft(RUN_D, planned, 2)
    gain = 1.0 - best / min(fixed.values())
    assert min(fixed, key=fixed.__getitem__) == 192 and 0.02 < gain < 0.03 and len(set(planned[:-1])) > 1
    assert plan_optimal(RUN_D, 4096, SMALL, margin=0.99 * gain) == planned
    for margin in (1.01 * gain, 0.04, 0.1):
        within = middle([x for x, t in fixed.items() if t <= best / (1 - margin)])
        assert plan_optimal(RUN_D, 4096, SMALL, margin=margin) == plan_fixed(4096, within)
    assert plan_optimal(RUN_D, 4096, SMALL, margin=0.04) == plan_fixed(4096, 256)  # of 192, 256, 320


@settings(max_examples=25, deadline=None)
@given(a=st.floats(1e-3, 10.0), b=st.floats(1.0, 1e5), c=st.floats(0.0, 1e9), gamma=st.floats(0.0, 1e4),
       prompt_len=st.integers(1, 200_000), pp=st.integers(2, 8), margin=st.floats(0.0, 0.3))
def test_with_a_margin_the_plan_is_the_middle_fixed_chunk_within_it_of_the_best(a, b, c, gamma, prompt_len, pp,
                                                                                   margin):
    model = LatencyModel(a, b, c, gamma)
    s = ChunkSettings(budget=8192, min_chunk_size=1024, pipeline_parallel_size=pp)
    plan = plan_optimal(model, prompt_len, s, margin=margin)
    assert sum(plan) == prompt_len
    best = predicted_ttft(model, plan_optimal(model, prompt_len, s), pp)
    sizes = planner_sizes(s)
    within = fixed_ttft_closed_form(model, prompt_len, sizes, pp) <= best / (1 - margin) * (1 + 1e-9)
    if within.any():
        assert plan == plan_fixed(prompt_len, middle(sizes[within].tolist()))
    else:
        assert predicted_ttft(model, plan, pp) == best
        assert not any(plan == plan_fixed(prompt_len, int(x)) for x in sizes)
