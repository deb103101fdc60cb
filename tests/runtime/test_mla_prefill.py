"""--mla-prefill at start-up (jaxcpp/runtime/mla_prefill.py): fixed modes give their weight without
timing anything; auto times both forms of one layer on the device and fits a weight that sorts the
timed points as they were measured."""

from __future__ import annotations

import logging
import math

import jax
import pytest

from jaxcpp.chunking.mla_cost import prefer_rebuild
from jaxcpp.runtime import mla_prefill
from tests.pipeline.test_deepseek_pipeline import deepseek_config


@pytest.mark.parametrize(("mode", "weight"), [("flops", 1.0), ("absorbed", math.inf), ("rebuilt", 0.0)])
def test_fixed_modes_time_nothing(monkeypatch, mode, weight):
    monkeypatch.setattr(mla_prefill, "time_forms", lambda *a, **k: pytest.fail("a fixed mode timed a form"))
    assert mla_prefill.rebuild_weight(mode, deepseek_config(), jax.devices()[0], 128, 16) == weight


def test_auto_measures_once_and_its_weight_sorts_the_timed_points(monkeypatch, caplog):
    config, device = deepseek_config(), jax.devices()[0]
    mla_prefill._MEASURED.clear()
    timed = []
    real = mla_prefill.time_forms
    monkeypatch.setattr(mla_prefill, "time_forms", lambda *a: timed.append(real(*a)) or timed[-1])
    with caplog.at_level(logging.INFO, logger="jaxcpp.runtime.mla_prefill"):
        weight = mla_prefill.rebuild_weight("auto", config, device, 128, 16)
        assert mla_prefill.rebuild_weight("auto", config, device, 128, 16) == weight  # the second stage: cached
    assert [(t.prefix_len, t.chunk) for t in timed] == [(128, 32), (128, 64), (128, 128)]
    assert all(t.absorbed_s > 0 and t.rebuilt_s > 0 for t in timed)
    shape = mla_prefill.MlaShape.of(config)
    agree = sum(prefer_rebuild(shape, t.prefix_len, t.chunk, weight) == (t.rebuilt_s < t.absorbed_s) for t in timed)
    flops = sum(prefer_rebuild(shape, t.prefix_len, t.chunk) == (t.rebuilt_s < t.absorbed_s) for t in timed)
    assert agree >= flops  # never sorts the measured points worse than the FLOP rule
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("MLA prefill: rebuild weight") and f"measured on {device.platform}" in line
               for line in lines)


def test_auto_times_the_stages_own_ops_for_each_backend(monkeypatch):
    """--attention-backend pallas: auto times the two Pallas ops the stages run (absorbed kernel, rebuilt
    fold kernel), xla the XLA ones, and each backend is measured apart (not served the other's weight)."""
    from jaxcpp.kernels.mla_attention import mla_absorbed_attention, mla_absorbed_xla, mla_prefill_rebuilt_xla
    from jaxcpp.kernels.mla_rebuilt import mla_prefill_rebuilt_attention

    config, device = deepseek_config(), jax.devices()[0]
    mla_prefill._MEASURED.clear()
    ops = []

    def fake(config, device, prefix_len, chunk, page_size, dtype, absorbed, rebuilt):
        ops.append((getattr(absorbed, "func", absorbed), getattr(rebuilt, "func", rebuilt)))
        return mla_prefill.FormTiming(prefix_len, chunk, 1.0, 2.0)

    monkeypatch.setattr(mla_prefill, "time_forms", fake)
    mla_prefill.rebuild_weight("auto", config, device, 128, 16, "pallas")
    mla_prefill.rebuild_weight("auto", config, device, 128, 16, "xla")
    pallas, xla = (mla_absorbed_attention, mla_prefill_rebuilt_attention), (mla_absorbed_xla, mla_prefill_rebuilt_xla)
    assert ops == [pallas] * 3 + [xla] * 3
