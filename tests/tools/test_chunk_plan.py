"""`jaxcpp chunk-plan`, run in-process: the engine's flags, the README's example in seconds, clear errors."""

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.planner import settings_from_config
from jaxcpp.cli_args import engine_config_from_args
from jaxcpp.config import DEFAULT_SMOOTH_FACTOR, EngineConfig
from jaxcpp.tools import chunk_plan as cli

README = Path(__file__).resolve().parents[2] / "README.md"

BASE = ["chunk-plan", "--prompt-len", "131072", "--max-num-batched-tokens", "32768",
        "--pipeline-parallel-size", "4"]


def test_prints_the_conformance_chunks_beside_fixed_plans(capsys):
    assert cli.main(BASE + ["--coeffs", "1,18500,0,1630", "--dynamic-chunking-smooth-factor", "1.0"]) == 0
    out = capsys.readouterr().out
    for chunk in (32768, 16192, 12416, 5504, 3840):
        assert f" {chunk} " in out
    assert "fixed 32768" in out and "fixed 16384" in out and "fixed 8192" in out


def test_json_for_machines_from_a_model_file(tmp_path, capsys):
    path = tmp_path / "m.json"
    LatencyModel(2.9e-10, 5.365e-6, 0.005, 4.727e-7).save(path)
    assert cli.main(BASE + ["--model-file", str(path), "--dynamic-chunking-policy", "optimal", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plans = {p["name"]: p for p in report["plans"]}
    assert sum(plans["optimal"]["chunks"]) == 131072
    assert plans["optimal"]["ttft"] <= min(p["ttft"] for p in report["plans"])
    assert len(plans["optimal"]["chunk_times"]) == len(plans["optimal"]["chunks"])


def test_the_fit_error_runs_the_middle_fixed_chunk_within_it(capsys):
    """Run D's real-compute fit (docs/benchmarks.md) at 4096 tokens: the engine, logging a fit error of
    4%, would run fixed 256-token chunks (of 192, 256, 320) where the model taken as exact plans its own."""
    small = ["chunk-plan", "--prompt-len", "4096", "--max-num-batched-tokens", "1024", "--pipeline-parallel-size",
             "2", "--dynamic-chunking-min-chunk-size", "128", "--dynamic-chunking-policy", "optimal",
             "--coeffs", "7.23e-8,1.04e-4,0.0069,0", "--json"]
    plans = {}
    for fit_error in ("0", "0.04"):
        assert cli.main(small + ["--fit-error", fit_error]) == 0
        plans[fit_error] = json.loads(capsys.readouterr().out)["plans"][0]["chunks"]
    assert len(set(plans["0"])) > 2 and plans["0.04"] == [256] * 16
    assert cli.main(small + ["--fit-error", "1"]) == 2
    assert "--fit-error must be in [0, 1), got 1.0" in capsys.readouterr().err


@pytest.mark.slow  # matplotlib's import is most of it
def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert cli.main(["chunk-plan", "--prompt-len", "20000", "--max-num-batched-tokens", "8192",
                     "--pipeline-parallel-size", "2", "--coeffs", "1,2000,0,100",
                     "--dynamic-chunking-min-chunk-size", "1024",
                     "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # matplotlib's import is most of it
def test_the_plot_shows_the_tables_ttft_and_says_where_it_went(tmp_path, capsys, monkeypatch):
    """The README's example: the optimal plan's uneven chunks once put 7.878 s in the plot's title
    beside 7.8716 in the table."""
    import matplotlib.axes

    titles: list[str] = []
    set_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **kw: (titles.append(label), set_title(self, label, *a, **kw))[1])
    out = tmp_path / "timeline.png"
    argv = BASE + ["--coeffs", "2.9e-10,5.365e-6,0.02,4.727e-7", "--dynamic-chunking-policy", "optimal"]
    assert cli.main(argv + ["--json", "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout stays JSON: the note goes to stderr
    assert captured.err.strip() == f"chunk-plan: wrote the timelines of fixed 32768 and optimal to {out}"
    for plan in report["plans"][:2]:
        title = next(t for t in titles if t.startswith(plan["name"] + ":"))
        assert f"TTFT {plan['ttft']:.6g} s" in title, (title, plan["ttft"])
    assert cli.main(argv) == 0
    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith(("optimal", "fixed 32768"))}
    assert f"{report['plans'][0]['ttft']:.6g}" == table["optimal"][3]


def test_bad_input_is_a_clear_error(capsys):
    assert cli.main(BASE + ["--coeffs", "1,2,3"]) == 2
    assert "four numbers" in capsys.readouterr().err


def test_add_parser_registers_on_a_foreign_parser():
    parser = argparse.ArgumentParser(prog="jaxcpp")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(BASE + ["--coeffs", "1,2,3,4"])
    assert args.func is cli.run and args.dynamic_chunking_policy is None  # left to ChunkingConfig's default


def test_engine_flags_build_the_settings_the_engine_would():
    """Same flag names as `jaxcpp serve`, same validation, same settings as the engine's config gives."""
    parser = argparse.ArgumentParser(prog="jaxcpp")
    cli.add_parser(parser.add_subparsers(dest="command"))
    argv = ["--max-num-batched-tokens", "8192", "--pipeline-parallel-size", "2", "--pp-partition", "3,5",
            "--page-size", "128", "--dynamic-chunking-min-chunk-size", "1024"]
    args = parser.parse_args(BASE[:3] + argv + ["--coeffs", "1,2,3,4"])
    settings = settings_from_config(engine_config_from_args(args))
    expected = settings_from_config(EngineConfig.from_kwargs(
        max_num_batched_tokens=8192, pipeline_parallel_size=2, pp_partition="3,5", page_size=128,
        dynamic_chunking_min_chunk_size=1024))
    assert settings == expected
    assert settings.stage_weights == (0.6, 1.0) and settings.alignment == 128
    assert settings.in_flight_depth == 3 and settings.max_prompt_steps_in_flight == 6  # P + async, doubled
    assert settings.smooth_factor == DEFAULT_SMOOTH_FACTOR


def test_engine_flag_errors_name_the_flag(capsys):
    assert cli.main(BASE + ["--coeffs", "1,2,3,4", "--pp-partition", "1,2"]) == 2
    assert "--pp-partition" in capsys.readouterr().err
    assert cli.main(BASE + ["--coeffs", "1,2,3,4", "--dynamic-chunking-smooth-factor", "2"]) == 2
    assert "--dynamic-chunking-smooth-factor" in capsys.readouterr().err


def readme_chunk_plan_argv() -> list[str]:
    text = README.read_text()
    match = re.search(r"jaxcpp (chunk-plan .*?)\n```", text, re.S)
    assert match, "README.md shows no `jaxcpp chunk-plan` example"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_readme_example_uses_seconds_and_plots_outside_the_repo(capsys, monkeypatch):
    argv = readme_chunk_plan_argv()
    plot = Path(argv[argv.index("--plot") + 1])
    assert plot.is_absolute() and README.parent not in plot.parents, plot
    monkeypatch.setattr("jaxcpp.tools.plot.plot_timelines", lambda runs, path, title: None)
    assert cli.main(argv + ["--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    # Real-scale per-stage coefficients: a 128K prefill on PP4 takes seconds, not 1e10 "seconds".
    assert all(0.1 < plan["ttft"] < 100.0 for plan in plans), [plan["ttft"] for plan in plans]
