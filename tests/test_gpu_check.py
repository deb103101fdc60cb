"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without a GPU: it says so and exits 0; with
--allow-cpu its engine part runs a tiny model from the checkout as laid out (no install), so the script
that a GPU day depends on is exercised here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "no GPU here" in res.stdout
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_allow_cpu_runs_the_engine_part_and_writes_the_report(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--allow-cpu", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    engine = report["engine"]
    assert engine["ok"] and engine["compilations_after_warmup"] == 0 and engine["tpot_1_ms"] > 0
    assert "| engine, random ~1B Llama, bfloat16 | ok" in (tmp_path / "gpu_check.md").read_text()
