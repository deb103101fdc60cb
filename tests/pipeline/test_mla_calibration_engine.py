"""Calibration on an MLA engine (issue 38, item 6): a real PP 2 engine on a random DeepSeek-V3 whose
prefill chunks all rebuild (`--mla-prefill rebuilt`) runs its start-up sweep and its runtime samples;
the engine tells calibration the form its planned chunks run, every fit tried keeps its error beside
the same samples' fit with γ forced to 0, and an installed model's log line shows γ and that error."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxcpp import LLM, SamplingParams
from tests.pipeline.conftest import random_params
from tests.pipeline.test_deepseek_pipeline import deepseek_config

pytestmark = pytest.mark.slow
PROMPT_LEN = 1536


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from jaxcpp.models.checkpoint import save_hf

    # hidden 256: an attention-free forward long enough for the start-up sweep to see b above timer noise
    config = deepseek_config(hidden_size=256, intermediate_size=512, max_position_embeddings=2048)
    folder = tmp_path_factory.mktemp("deepseek_v3_calibration")
    save_hf(folder, random_params(config, 5), config)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jaxcpp.chunking")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(model=str(folder), dtype="float32", max_model_len=PROMPT_LEN + 16, max_num_batched_tokens=512,
                  max_num_seqs=4, pipeline_parallel_size=2, log_stats_interval_s=0, enable_prefix_caching=False,
                  enable_dynamic_chunking=True, dynamic_chunking_min_chunk_size=64, mla_prefill="rebuilt")
        rng = np.random.default_rng(0)
        greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for _ in range(10):  # sole prefills, base chunks alternating 512 and 128, until calibration ends
            if llm.engine.chunking.state != "calibrating":
                break
            llm.generate(prompt_token_ids=[[int(t) for t in rng.integers(3, 120, PROMPT_LEN)]], sampling_params=greedy)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    yield llm, [r.getMessage() for r in records]
    llm.engine.executor.close()


def test_the_engine_tells_calibration_its_chunks_rebuild(calibrated):
    llm, lines = calibrated
    assert llm.engine.executor.mla_rebuild_weight == 0.0  # --mla-prefill rebuilt: every prefill chunk
    controller = llm.engine.chunking
    assert controller.prefill_form == "rebuilt" and controller.calibrator.with_gamma
    assert any("attend rebuilt, so calibration fits gamma" in line for line in lines)


def test_gamma_fit_is_no_worse_than_gamma_zero_and_the_install_line_shows_both(calibrated):
    llm, lines = calibrated
    controller, calibrator = llm.engine.chunking, llm.engine.chunking.calibrator
    if calibrator.b is None:  # a start-up sweep that timing noise made unusable is logged, not fitted
        pytest.skip(f"calibration ended at start-up on this machine: {calibrator.give_up_reason or controller.state}")
    assert calibrator.last_fit_errors is not None, "two prompts of two base sizes make a fit"
    with_gamma, gamma_zero = calibrator.last_fit_errors
    assert with_gamma <= gamma_zero + 1e-12  # the samples all rebuild: γ·L can only fit them better
    if controller.state == "installed":
        line = next(line for line in lines if "latency model installed" in line)
        assert f"gamma={controller.model.gamma:.6g}" in line
        assert f"gamma forced to 0: {controller.gamma_zero_fit_error:.2%}" in line
        stats = llm.engine.stats().dynamic_chunking
        assert stats["fit_error"] <= stats["fit_error_gamma0"]
    else:  # noise rejected every fit: each rejection is logged with its reason
        assert controller.state == "gave_up" and any("fit rejected" in line for line in lines)
