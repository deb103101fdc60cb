"""`jaxcpp chunk-plan`, run in-process."""

import argparse
import json

import pytest

from jaxcpp.chunking import cli
from jaxcpp.chunking.latency_model import LatencyModel

BASE = ["chunk-plan", "--prompt-len", "131072", "--max-num-batched-tokens", "32768",
        "--pipeline-parallel-size", "4"]


def test_prints_the_conformance_chunks_beside_fixed_plans(capsys):
    assert cli.main(BASE + ["--coeffs", "1,18500,0,1630", "--smooth-factor", "1.0"]) == 0
    out = capsys.readouterr().out
    for chunk in (32768, 16192, 12416, 5504, 3840):
        assert f" {chunk} " in out
    assert "fixed 32768" in out and "fixed 16384" in out and "fixed 8192" in out


def test_json_for_machines_from_a_model_file(tmp_path, capsys):
    path = tmp_path / "m.json"
    LatencyModel(2.9e-10, 5.365e-6, 0.005, 4.727e-7).save(path)
    assert cli.main(BASE + ["--model-file", str(path), "--policy", "optimal", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plans = {p["name"]: p for p in report["plans"]}
    assert sum(plans["optimal"]["chunks"]) == 131072
    assert plans["optimal"]["ttft"] <= min(p["ttft"] for p in report["plans"])
    assert len(plans["optimal"]["chunk_times"]) == len(plans["optimal"]["chunks"])


@pytest.mark.slow  # matplotlib's import is most of it
def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert cli.main(["chunk-plan", "--prompt-len", "20000", "--max-num-batched-tokens", "8192",
                     "--pipeline-parallel-size", "2", "--coeffs", "1,2000,0,100", "--min-chunk-size", "1024",
                     "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_a_clear_error(capsys):
    assert cli.main(BASE + ["--coeffs", "1,2,3"]) == 2
    assert "four numbers" in capsys.readouterr().err


def test_add_parser_registers_on_a_foreign_parser():
    parser = argparse.ArgumentParser(prog="jaxcpp")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(BASE + ["--coeffs", "1,2,3,4"])
    assert args.func is cli.run and args.policy == "equal-latency"
