"""DynamicChunkController: the state machine the scheduler drives."""

import logging

import pytest

from jaxcpp.chunking.controller import DynamicChunkController, format_report
from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.load import ROUNDS_AHEAD
from jaxcpp.chunking.makespan import predicted_ttft
from jaxcpp.chunking.optimal import plan_optimal, planner_sizes
from jaxcpp.chunking.planner import ChunkSettings, plan_fixed
from jaxcpp.config import EngineConfig

A = 2.9e-10
TRUE = LatencyModel(a=A, b=18500 * A, c=0.005, gamma=1630 * A)
SETTINGS = ChunkSettings(budget=32768, smooth_factor=0.75, min_chunk_size=4096, pipeline_parallel_size=4)


def prefill_alone(ctl, request_id, prompt_len, model=TRUE, budget=32768):
    """Drive one prompt to completion as the sole prefill, timing each chunk with `model`."""
    done, chunks = 0, []
    while done < prompt_len:
        ctl.observe_step(1)
        chunk = ctl.chunk_size_for(request_id, prompt_len, done, budget)
        ctl.record_timing(chunk, done, float(model.predict(done, chunk)), True, request_id)
        chunks.append(chunk)
        done += chunk
    ctl.finish_request(request_id)
    return chunks


def test_calibrates_by_alternating_bases_then_installs_and_logs(caplog):
    ctl = DynamicChunkController(SETTINGS)
    ctl.set_startup_fit(TRUE.b, TRUE.c)
    assert ctl.state == "calibrating" and ctl.needs_ack
    with caplog.at_level(logging.INFO, logger="jaxcpp.chunking"):
        assert prefill_alone(ctl, "r0", 131072) == [32768] * 4       # budget; discarded by calibration
        assert prefill_alone(ctl, "r1", 131072) == [8192] * 16       # max(budget / 4, min chunk)
        r2 = prefill_alone(ctl, "r2", 131072)
    # installed on r2's second sample (its base size then seen at two prefixes), sized from then on
    assert r2[:2] == [32768, 32768] and r2[2] < 32768
    assert ctl.state == "installed"
    assert ctl.model.a == pytest.approx(TRUE.a, rel=1e-6)
    assert any(r.message.startswith("Dynamic chunking latency model installed: a=") for r in caplog.records)
    counts = ctl.report_counts()
    assert counts["calibration"] == 4 + 16 + 2 and counts["model"] == len(r2) - 2
    assert ctl.report_counts() == dict.fromkeys(counts, 0)


def test_the_install_line_and_stats_show_gamma_beside_the_gamma_zero_fit(caplog):
    """Item 6 of the MLA issue: the installed model's line shows γ and the error of the same samples
    fitted with γ forced to 0; stats carry it too. An MLA model whose planned chunks attend absorbed
    (`set_prefill_form`) installs γ = 0."""
    ctl = DynamicChunkController(SETTINGS)
    ctl.set_startup_fit(TRUE.b, TRUE.c)
    with caplog.at_level(logging.INFO, logger="jaxcpp.chunking"):
        for request_id in ("r0", "r1", "r2"):
            prefill_alone(ctl, request_id, 131072)
    line = next(r.message for r in caplog.records if "latency model installed" in r.message)
    assert f"gamma={ctl.model.gamma:.6g}" in line and ctl.model.gamma == pytest.approx(TRUE.gamma, rel=1e-6)
    assert f"; gamma forced to 0: {ctl.gamma_zero_fit_error:.2%})" in line
    stats = ctl.stats()
    assert stats["fit_error_gamma0"] == ctl.gamma_zero_fit_error > 0.01 > stats["fit_error"]
    absorbed = DynamicChunkController(SETTINGS)
    absorbed.set_prefill_form("absorbed")
    absorbed.set_startup_fit(TRUE.b, TRUE.c)
    for request_id in ("r0", "r1", "r2", "r3"):
        prefill_alone(absorbed, request_id, 131072, model=LatencyModel(TRUE.a, TRUE.b, TRUE.c, 0.0))
    assert absorbed.state == "installed" and absorbed.model.gamma == 0.0


def test_a_prompts_remainder_is_not_a_second_chunk_size():
    """One base size along the prefix plus the last chunk's remainder leave a against γ resting on one
    sample: not ready until a second size is seen at two prefixes (it was, and on real compute such a
    fit installed a = 5.4e-9, γ = 8.3e-6, predicting 55-76% short)."""
    ctl = DynamicChunkController(SETTINGS)
    ctl.set_startup_fit(TRUE.b, TRUE.c)
    prefill_alone(ctl, "r0", 131072)                                  # discarded
    assert prefill_alone(ctl, "r1", 16 * 8192 + 4096) == [8192] * 16 + [4096]
    assert ctl.state == "calibrating"
    assert ctl.calibrator.readiness() == "1 distinct chunk sizes sampled at 2+ prefixes, needs 2"


def test_installed_equal_latency_shrinks_chunks_and_counts_them():
    ctl = DynamicChunkController(SETTINGS, model=TRUE)
    chunks = prefill_alone(ctl, "r", 131072)
    assert chunks[0] == 32768 and chunks[1] < 32768 and sum(chunks) == 131072
    assert ctl.report_counts()["model"] == len(chunks)


def test_concurrent_prefills_keep_the_fixed_chunk_for_sixteen_steps():
    ctl = DynamicChunkController(SETTINGS, model=TRUE)
    ctl.observe_step(2)
    assert ctl.chunk_size_for("a", 131072, 32768, 32768) == 32768
    for _ in range(15):
        ctl.observe_step(1)
        assert ctl.chunk_size_for("a", 131072, 32768, 32768) == 32768
    ctl.observe_step(1)
    assert ctl.chunk_size_for("a", 131072, 32768, 32768) < 32768
    counts = ctl.report_counts()
    assert counts["fixed_concurrent"] == 16 and counts["model"] == 1
    assert "16 (other prefills present)" in format_report(counts)


def test_unreachable_is_counted_and_single_forward_keeps_the_budget():
    steep = LatencyModel(a=1.0, b=10.0, c=0.0, gamma=1e6)
    ctl = DynamicChunkController(SETTINGS, model=steep)
    ctl.observe_step(1)
    assert ctl.chunk_size_for("r", 200_000, 100_000, 32768) == 32768
    assert ctl.report_counts()["fixed_unreachable"] == 1
    ctl = DynamicChunkController(SETTINGS, model=TRUE)
    assert ctl.chunk_size_for("r", 131072, 65536, 32768, single_forward=True) == 32768


def test_optimal_policy_follows_its_plan_and_replans_when_the_budget_cuts_it():
    ctl = DynamicChunkController(SETTINGS, policy="optimal", model=TRUE)
    chunks = prefill_alone(ctl, "r", 131072)
    assert sum(chunks) == 131072 and len(set(chunks)) > 2
    ctl.observe_step(1)
    first = ctl.chunk_size_for("s", 131072, 0, 32768)
    ctl.observe_step(1)  # the scheduler asks a prompt for one chunk per step
    cut = ctl.chunk_size_for("s", 131072, first, 1000)  # a step with little budget left
    assert cut == 960
    ctl.observe_step(1)
    assert ctl.chunk_size_for("s", 131072, first + cut, 32768) > 0  # replanned from there


class Noisy:
    """Timings of `model`, each times the next factor of `noise` in turn."""

    def __init__(self, model, noise):
        self.model, self.noise, self.calls = model, noise, 0

    def predict(self, prefix, chunk):
        self.calls += 1
        return self.model.predict(prefix, chunk) * self.noise[self.calls % len(self.noise)]


def test_optimal_departs_from_fixed_chunks_only_for_a_gain_above_the_fit_error():
    """Calibrated on 4096-token prompts (budget 1024, PP 2) from timings of run D's real-compute fit:
    exact, the plan is optimal's own; ±4% off, the fit misses its samples by more than the gain that plan
    predicts over the best fixed chunk, so the controller runs the middle one of the fixed chunks within
    the fit error of it."""
    run_d = LatencyModel(a=7.23e-8, b=1.04e-4, c=0.0069, gamma=0.0)
    small = ChunkSettings(budget=1024, min_chunk_size=128, pipeline_parallel_size=2)

    def calibrated(noise):
        ctl = DynamicChunkController(small, policy="optimal")
        ctl.set_startup_fit(run_d.b, run_d.c)
        timings = Noisy(run_d, noise)
        for i in range(6):
            prefill_alone(ctl, f"calibration {i}", 4096, model=timings, budget=1024)
        assert ctl.state == "installed" and ctl.stats()["fit_error"] == ctl.fit_error
        return ctl

    exact = calibrated([1.0])
    assert exact.fit_error < 1e-9
    assert prefill_alone(exact, "r", 4096, budget=1024) == plan_optimal(exact.model, 4096, small)
    rough = calibrated([1.04, 0.96, 0.96, 1.04])
    fixed = {int(x): predicted_ttft(rough.model, plan_fixed(4096, int(x)), 2) for x in planner_sizes(small)}
    best = predicted_ttft(rough.model, plan_optimal(rough.model, 4096, small), 2)
    assert rough.fit_error > 1 - best / min(fixed.values()) > 0.01
    within = sorted(x for x, t in fixed.items() if t <= best / (1 - rough.fit_error))
    assert len(within) > 2
    assert prefill_alone(rough, "r", 4096, budget=1024) == plan_fixed(4096, within[len(within) // 2])


def test_optimal_prefills_long_prompts_one_at_a_time_in_their_own_plans():
    """With other prefills queued, `optimal` gives the step's planned chunk to the first prompt asked
    (the oldest); a later long prompt waits its turn (0), a short one that fits whole joins the step.
    The oldest plans with the prompts behind it in mind (its chunks hold stage 0 once for each of
    them): fewer, larger chunks than alone; the next one, alone by then, plans as a lone prompt."""
    ctl = DynamicChunkController(SETTINGS, policy="optimal", model=TRUE)
    alone = prefill_alone(ctl, "alone", 131072)
    ahead = plan_optimal(TRUE, 131072, SETTINGS, queued=2)
    assert ahead[0] > alone[0] and len(ahead) < len(alone) and sum(ahead) == sum(alone) == 131072
    ctl.observe_step(3)  # three prompts could prefill: the sole-prefill gate is closed
    assert ctl.chunk_size_for("a", 131072, 0, 32768) == ahead[0]
    assert ctl.chunk_size_for("b", 131072, 0, 32768 - ahead[0]) == 0
    assert ctl.chunk_size_for("c", 500, 0, 32768 - ahead[0]) == 500
    done = ahead[0]
    for planned in ahead[1:]:  # "a" keeps its plan while "b" waits
        ctl.observe_step(2)
        assert ctl.chunk_size_for("a", 131072, done, 32768) == planned
        assert ctl.chunk_size_for("b", 131072, 0, 32768 - planned) == 0
        done += planned
    ctl.finish_request("a")
    ctl.observe_step(1)
    assert ctl.chunk_size_for("b", 131072, 0, 32768) == alone[0]  # now b's turn, alone: a lone plan
    assert ctl.report_counts()["fixed_concurrent"] == 0


def test_optimal_plans_prompts_as_a_stream_while_others_keep_arriving():
    """Two prompts at once are a batch: the first is planned with one behind it. A third that comes
    while it prefills makes the load sustained: its rest is replanned from where it is, as one of a
    stream (the prompts behind it and, ROUNDS_AHEAD times, each of the most seen at once wait for its
    stage-0 time), and so is the next prompt. One that comes to an empty prefill queue is planned alone."""
    ctl = DynamicChunkController(SETTINGS, policy="optimal", model=TRUE)

    def prefill(request_id, start, sources):
        """The rest of one prompt from `start`, `sources` prefill sources observed before each step."""
        done, chunks = start, []
        while done < 131072:
            ctl.observe_step(sources)
            chunks.append(ctl.chunk_size_for(request_id, 131072, done, 32768))
            done += chunks[-1]
        ctl.finish_request(request_id)
        return chunks

    ctl.observe_step(2)
    batch = plan_optimal(TRUE, 131072, SETTINGS, queued=1)
    assert ctl.chunk_size_for("a", 131072, 0, 32768) == batch[0]
    rest = plan_optimal(TRUE, 131072, SETTINGS, start=batch[0], queued=2 + ROUNDS_AHEAD * 3, sustained=True)
    assert rest[0] > batch[1]  # fewer, larger chunks than the batch plan's
    assert prefill("a", batch[0], sources=3) == rest  # "c" came at once
    stream = plan_optimal(TRUE, 131072, SETTINGS, queued=1 + ROUNDS_AHEAD * 3, sustained=True)
    assert prefill("b", 0, sources=2) == stream
    assert prefill("c", 0, sources=1) == plan_optimal(TRUE, 131072, SETTINGS, queued=ROUNDS_AHEAD * 3,
                                                      sustained=True)
    assert prefill("d", 0, sources=1) == plan_optimal(TRUE, 131072, SETTINGS)  # came to an empty queue


def test_turns_off_when_not_applicable(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxcpp.chunking"):
        collapsed = DynamicChunkController(ChunkSettings(budget=4096, min_chunk_size=4096,
                                                         pipeline_parallel_size=4))
        decode_only = DynamicChunkController(SETTINGS, runs_prefills=False)
        no_pipeline = DynamicChunkController(ChunkSettings(budget=32768, pipeline_parallel_size=1))
    assert collapsed.state == decode_only.state == no_pipeline.state == "off"
    assert "calibration chunk sizes collapse" in caplog.text and "decode-only" in caplog.text
    assert collapsed.chunk_size_for("r", 10_000, 0, 4096) == 4096
    assert DynamicChunkController(SETTINGS, enabled=False).state == "off"


def test_gives_up_without_a_startup_baseline_and_keeps_fixed_chunks():
    ctl = DynamicChunkController(ChunkSettings(budget=256, min_chunk_size=64, pipeline_parallel_size=2))
    ctl.run_startup_sweep(lambda n: 1e-6 * n)
    assert ctl.state == "gave_up" and not ctl.needs_ack
    ctl.observe_step(1)
    assert ctl.chunk_size_for("r", 1000, 0, 256) == 256


def test_startup_sweep_installs_b_and_c():
    ctl = DynamicChunkController(SETTINGS)
    ctl.run_startup_sweep(lambda n: TRUE.c + TRUE.b * n)
    assert ctl.calibrator.b == pytest.approx(TRUE.b) and ctl.state == "calibrating"


def test_from_config_and_scheduler_protocol():
    config = EngineConfig.from_kwargs(enable_dynamic_chunking=True, pipeline_parallel_size=4,
                                      max_num_batched_tokens=2048, dynamic_chunking_min_chunk_size=256,
                                      dynamic_chunking_policy="optimal", pp_partition="2,2,2,3")
    ctl = DynamicChunkController.from_config(config, allowed_sizes=(256, 512, 1024, 2048))
    assert ctl.state == "calibrating" and ctl.policy == "optimal"
    assert ctl.settings.stage_weights == (2 / 3, 2 / 3, 2 / 3, 1.0)

    class Seq:
        request_id, num_computed_tokens, num_remaining = "q", 0, 5000

    ctl.observe_step(1)
    assert ctl.prefill_chunk(Seq(), 2048) == 2048
