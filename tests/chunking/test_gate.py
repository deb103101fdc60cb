"""The sole-prefill gate over a 16-step window."""

import pytest

from jaxcpp.chunking.gate import GATE_WINDOW_STEPS, SolePrefillGate


def test_open_before_any_step_and_while_alone():
    gate = SolePrefillGate()
    assert gate.is_open
    for n in (1, 0, 1, 1):
        gate.observe(n)
    assert gate.is_open


def test_one_concurrent_step_closes_it_for_sixteen_steps():
    assert GATE_WINDOW_STEPS == 16
    gate = SolePrefillGate()
    gate.observe(1)
    gate.observe(2)
    assert not gate.is_open and gate.steps_until_open == 16
    for i in range(15):
        gate.observe(1)
        assert not gate.is_open, f"opened after {i + 1} quiet steps"
    assert gate.steps_until_open == 1
    gate.observe(1)
    assert gate.is_open and gate.steps_until_open == 0


def test_rejects_negative_counts():
    with pytest.raises(ValueError):
        SolePrefillGate().observe(-1)
    with pytest.raises(ValueError):
        SolePrefillGate(window=0)
