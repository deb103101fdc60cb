"""Start-up sweep and fit, runtime fit and its checks, and the calibrator's give-up rules."""

import numpy as np
import pytest

from jaxcpp.chunking import calibration
from jaxcpp.chunking.calibration import RuntimeCalibrator, run_startup_sweep, startup_sweep_sizes
from jaxcpp.chunking.fitting import Rejection, fit_runtime, fit_startup
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.planner import ChunkSettings

A = 2.9e-10
TRUE = LatencyModel(a=A, b=18500 * A, c=0.005, gamma=1630 * A)  # seconds; the Kimi-K2.5 ratios
BUDGET = 32768


def grid(chunks=(32768, 8192), prompt_len=131072):
    """(chunk, prefix) shapes that fixed chunks of each size visit in one prompt."""
    shapes = [(x, L) for x in chunks for L in range(0, prompt_len, x)]
    return np.array([s[0] for s in shapes]), np.array([s[1] for s in shapes])


def times(model, x, L, noise=None):
    t = model.predict(L.astype(float), x.astype(float))
    return t if noise is None else t * (1.0 + np.asarray(noise))


# ----- start-up ------------------------------------------------------------------------------------------
def test_sweep_sizes_are_24_aligned_sizes_from_the_budget_down_to_an_eighth():
    plan = startup_sweep_sizes(ChunkSettings(budget=BUDGET))
    assert len(plan.sizes) == 24 and plan.sizes[0] == 32768 and plan.sizes[-1] == 4096
    assert all(s % 64 == 0 for s in plan.sizes) and plan.sizes == sorted(set(plan.sizes), reverse=True)
    assert startup_sweep_sizes(ChunkSettings(budget=BUDGET), max_model_len=15999).sizes[0] == 15936


def test_fewer_than_eight_sizes_gives_no_baseline_and_says_why():
    assert len(startup_sweep_sizes(ChunkSettings(budget=512)).sizes) == 8  # 64..512: just enough
    plan = startup_sweep_sizes(ChunkSettings(budget=256))
    assert plan.sizes == [] and "only 4 distinct chunk sizes" in plan.reason


def test_sweep_is_one_warmup_then_best_of_two_and_errors_propagate():
    calls = []

    def forward(n):
        calls.append(n)
        return float(n) + (1.0 if len(calls) % 2 else 0.0)  # odd calls are slower

    sizes = startup_sweep_sizes(ChunkSettings(budget=BUDGET)).sizes
    best = run_startup_sweep(forward, sizes)
    assert len(calls) == 49 and calls[0] == max(sizes)
    assert best == [float(s) for s in sizes]

    def broken(n):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        run_startup_sweep(broken, sizes)


def test_startup_fit_recovers_b_c_rejects_flat_and_clamps_c():
    sizes = np.array(startup_sweep_sizes(ChunkSettings(budget=BUDGET)).sizes)
    b, c = fit_startup(sizes, TRUE.c + TRUE.b * sizes)
    assert b == pytest.approx(TRUE.b, rel=1e-9) and c == pytest.approx(TRUE.c, rel=1e-6)
    assert isinstance(fit_startup(sizes, 0.3 - 1e-6 * sizes), Rejection)
    assert fit_startup(sizes, -0.01 + TRUE.b * sizes)[1] == 0.0


# ----- runtime fit ---------------------------------------------------------------------------------------
def test_runtime_fit_recovers_a_gamma_c_from_exact_data():
    x, L = grid()
    model = fit_runtime(x, L, times(TRUE, x, L), TRUE.b, 0.001, BUDGET)
    assert isinstance(model, LatencyModel)
    for key in ("a", "c", "gamma"):
        assert getattr(model, key) == pytest.approx(getattr(TRUE, key), rel=1e-6)
    assert model.b == TRUE.b


def test_flat_cost_shows_no_attention_growth():
    x, L = grid()
    result = fit_runtime(x, L, TRUE.c + TRUE.b * x, TRUE.b, TRUE.c, BUDGET)
    assert isinstance(result, Rejection) and "no growth above noise" in result.reason


def test_ill_conditioned_grid_is_rejected():
    x, L = grid(chunks=(8192, 8256), prompt_len=65536)  # two near-equal sizes: 2Lx + x² ~ L
    result = fit_runtime(x, L, times(TRUE, x, L), TRUE.b, TRUE.c, BUDGET)
    assert isinstance(result, Rejection) and "condition number" in result.reason


EARLY = (np.array([32768, 32768, 32768, 8192, 8192, 8192, 8192, 8192]),
         np.array([0, 32768, 65536, 0, 8192, 16384, 24576, 32768]))


def test_six_percent_noise_is_too_uncertain_but_half_a_percent_is_fine():
    x, L = EARLY
    signs = np.array([1, -1] * 4)
    noisy = fit_runtime(x, L, times(TRUE, x, L, 0.06 * signs), TRUE.b, TRUE.c, BUDGET)
    assert isinstance(noisy, Rejection) and "prediction standard error" in noisy.reason
    quiet = fit_runtime(x, L, times(TRUE, x, L, 0.005 * signs), TRUE.b, TRUE.c, BUDGET)
    assert isinstance(quiet, LatencyModel) and quiet.a == pytest.approx(TRUE.a, rel=0.05)


def test_large_residual_is_rejected():
    x, L = grid()
    result = fit_runtime(x, L, times(TRUE, x, L, 0.6 * np.resize([1, -1, -1, 1], len(x))),
                         TRUE.b, TRUE.c, BUDGET)
    assert isinstance(result, Rejection) and "RMS residual" in result.reason


def test_negative_gamma_is_dropped_and_negative_c_pinned_to_the_startup_c():
    x, L = grid()
    faster_with_prefix = LatencyModel(a=A, b=TRUE.b, c=0.005, gamma=-300 * A)
    model = fit_runtime(x, L, times(faster_with_prefix, x, L), TRUE.b, TRUE.c, BUDGET)
    assert isinstance(model, LatencyModel) and model.gamma == 0.0
    negative_c = LatencyModel(a=A, b=TRUE.b, c=-0.02, gamma=TRUE.gamma)
    model = fit_runtime(x, L, times(negative_c, x, L), TRUE.b, 0.004, BUDGET)
    assert isinstance(model, LatencyModel) and model.c == 0.004


def test_no_useful_shrink_is_rejected():
    linear_heavy = LatencyModel(a=A, b=3e6 * A, c=0.005, gamma=0.0)  # attention measurable, yet tiny
    x, L = grid()
    result = fit_runtime(x, L, times(linear_heavy, x, L), linear_heavy.b, 0.005, BUDGET)
    assert isinstance(result, Rejection) and "no useful shrink" in result.reason


# ----- the calibrator ------------------------------------------------------------------------------------
def feed(cal, request_id, chunk, prompt_len, model=TRUE, scale=1.0):
    for prefix in range(0, prompt_len, chunk):
        x = min(chunk, prompt_len - prefix)
        cal.record(x, prefix, scale * float(model.predict(prefix, x)), request_id)


def test_calibrator_discards_the_first_request_then_accepts():
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    feed(cal, "warm-up", 32768, 131072, scale=5.0)  # compile-time outliers: must not count
    assert cal.num_shapes == 0
    feed(cal, "r1", 8192, 131072)
    assert cal.status == "collecting" and "chunk sizes" in cal.readiness()
    feed(cal, "r2", 32768, 131072)
    assert cal.status == "accepted" and cal.model.a == pytest.approx(TRUE.a, rel=1e-6)


def test_the_accepted_fit_reports_its_error_over_its_own_samples():
    exact = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    for request_id, chunk in (("warm-up", 32768), ("r1", 8192), ("r2", 32768)):
        feed(exact, request_id, chunk, 131072)
    assert exact.status == "accepted" and exact.fit_error < 1e-9
    noisy = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    shapes = []
    for request_id, chunk in (("warm-up", 32768), ("r1", 8192), ("r2", 32768), ("r3", 8192)):
        for n, prefix in enumerate(range(0, 131072, chunk)):
            seconds = float(TRUE.predict(prefix, chunk)) * (1.03 if n % 2 else 0.97)
            if noisy.status == "collecting" and request_id != "warm-up":
                shapes.append((chunk, prefix, seconds))
            noisy.record(chunk, prefix, seconds, request_id)
    assert noisy.status == "accepted"
    x, L, t = (np.array(column, dtype=np.float64) for column in zip(*shapes, strict=True))
    residual = t - noisy.model.predict(L, x)
    assert noisy.fit_error == pytest.approx(np.sqrt(np.mean(residual**2)) / t.mean(), rel=1e-9)
    assert 0.02 < noisy.fit_error < 0.04  # ±3% of each time; the long chunks weigh more


def test_one_prefix_never_fits():
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    for i, n in enumerate([1000, 2000, 4000, 8000, 16000, 32000, 30000, 20000]):
        cal.record(n, 0, float(TRUE.predict(0, n)), f"r{i}")
    assert cal.status == "collecting" and "1 distinct prefixes" in cal.readiness()
    assert cal.maybe_fit() is None


def test_one_chunk_size_gives_up_after_eight_sampled_requests():
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    for i in range(9):  # the first is discarded
        feed(cal, f"r{i}", 8192, 65536)
    assert cal.status == "gave_up" and "fewer than 2 chunk sizes" in cal.give_up_reason


def test_eight_rejected_fits_give_up_with_the_last_reason():
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    flat = LatencyModel(a=0.0, b=TRUE.b, c=TRUE.c, gamma=0.0)
    feed(cal, "warm-up", 8192, 8192)
    feed(cal, "r1", 8192, 131072, flat)
    feed(cal, "r2", 32768, 131072, flat)
    feed(cal, "r3", 16384, 131072, flat)
    assert cal.status == "gave_up" and len(cal.rejections) == 8
    assert "8 fits rejected" in cal.give_up_reason and "no growth" in cal.give_up_reason


def test_timings_per_shape_are_capped_and_reduced_by_median():
    cal = RuntimeCalibrator(BUDGET)  # no start-up fit: collects, never fits
    for i, t in enumerate([1.0, 9.0, 2.0, 3.0, 100.0, 100.0]):
        cal.record(4096, 0, t, "first" if i == 0 else "r")
    assert cal._shapes[(4096, 0)].timings == [9.0, 2.0, 3.0, 100.0]
    assert cal._shapes[(4096, 0)].median() == 6.0
    assert "no start-up fit" in cal.readiness()


def test_shapes_are_capped(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_SHAPES", 3)
    cal = RuntimeCalibrator(BUDGET)
    cal.record(64, 0, 1.0, "first")
    for prefix in range(10):
        cal.record(64, prefix, 1.0, "r")
    assert cal.num_shapes == 3


def test_a_long_stretch_without_samples_gives_up(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_STEPS_WITHOUT_SAMPLE", 5)
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    for _ in range(4):
        cal.tick()
    assert cal.status == "collecting"
    cal.tick()
    assert cal.status == "gave_up" and "no sole-prefill timing for 5" in cal.give_up_reason


def test_gamma_forced_to_zero_is_fitted_beside_and_fits_a_rebuild_worse():
    """An MLA model's rebuilt chunks pay γ·L (here the Kimi-K2.5 ratio): the accepted fit keeps γ and
    reports what the same samples give with γ forced to 0, which must fit them worse."""
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    for request_id, chunk in (("warm-up", 32768), ("r1", 8192), ("r2", 32768)):
        feed(cal, request_id, chunk, 131072)
    assert cal.status == "accepted" and cal.model.gamma == pytest.approx(TRUE.gamma, rel=1e-6)
    assert cal.last_fit_errors == (cal.fit_error, cal.gamma_zero_fit_error)
    assert cal.fit_error < 1e-9 < 0.01 < cal.gamma_zero_fit_error


def test_absorbed_chunks_hold_gamma_at_zero():
    """`with_gamma=False` (an MLA model whose planned chunks attend absorbed): no γ column, whatever
    the samples say; the comparison is still kept."""
    absorbed = LatencyModel(a=TRUE.a, b=TRUE.b, c=TRUE.c, gamma=0.0)
    noise = iter(np.tile([1.002, 0.998], 64))
    cal = RuntimeCalibrator(BUDGET, TRUE.b, TRUE.c)
    cal.with_gamma = False
    for request_id, chunk in (("warm-up", 32768), ("r1", 8192), ("r2", 32768)):
        for prefix in range(0, 131072, chunk):
            cal.record(chunk, prefix, float(absorbed.predict(prefix, chunk)) * next(noise), request_id)
    assert cal.status == "accepted" and cal.model.gamma == 0.0
    assert cal.gamma_zero_fit_error == pytest.approx(cal.fit_error, rel=1e-9)
