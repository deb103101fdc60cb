"""benchmarks/serving.py: arrival process, statistics, and one short run against a fake-engine server."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

from tests.serving.fakes import fake_engine

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("benchmark_serving", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_arrivals_have_the_requested_rate() -> None:
    rng = np.random.default_rng(0)
    for burstiness in (1.0, 0.5, 4.0):
        gaps = bench.arrival_gaps(20000, 10.0, burstiness, rng)
        assert abs(np.mean(gaps) - 0.1) < 0.005
    assert bench.arrival_gaps(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]


def test_summary_and_goodput() -> None:
    R = bench.RequestResult
    results = [R("normal", 10, 0.0, True, output_len=3, ttft=0.1, e2el=0.3, itl=[0.1, 0.1]),
               R("normal", 10, 0.0, True, output_len=3, ttft=0.5, e2el=0.9, itl=[0.2, 0.2]),
               R("long", 100, 1.0, True, output_len=1, ttft=2.0, e2el=2.0),
               R("normal", 10, 0.0, False, error="boom")]
    s = bench.summarize(results, 2.0, [99], bench.parse_goodput(["ttft:200"]))
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 1, 7)
    assert s["ttft_ms"]["mean"] == 300.0 and s["itl_ms"]["median"] == 150.0
    assert s["tpot_ms"]["mean"] == 150.0
    assert s["request_goodput"] == 0.5 and s["long_prompt_ttft_ms"]["mean"] == 2000.0


def test_run_against_a_server(serve, tmp_path: Path) -> None:
    server = serve(fake_engine(max_model_len=1024))
    out = tmp_path / "result.json"
    rc = bench.main(["run", "--target", f"127.0.0.1:{server.port}", "--num-prompts", "12", "--request-rate",
                     "200", "--max-concurrency", "4", "--random-input-len", "8", "--random-output-len", "6",
                     "--inject-long-prompt", "300", "--inject-at", "0", "--result-file", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["total_output_tokens"]) == (13, 12 * 6 + 4)
    assert s["long_prompt_ttft_ms"] is not None
    assert all(len(r["itl"]) == r["output_len"] - 1 for r in result["requests"])


def test_run_against_the_openai_api(serve, tmp_path: Path) -> None:
    server = serve(fake_engine(max_model_len=1024))
    out = tmp_path / "result.json"
    rc = bench.main(["run", "--backend", "openai", "--target", f"http://127.0.0.1:{server.http_port}/v1",
                     "--vocab-size", "128", "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "8",
                     "--random-output-len", "6", "--result-file", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert (result["summary"]["completed"], result["summary"]["total_output_tokens"]) == (8, 8 * 6)
    assert all(len(r["itl"]) == r["output_len"] - 1 and r["ttft"] > 0 for r in result["requests"])
