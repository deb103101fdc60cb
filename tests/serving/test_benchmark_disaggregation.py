"""benchmarks/disaggregation.py: the workload split between colocated engines, the driver against two
fake-engine servers, the KV layout's bytes per token and the tables' ratios (the timed runs need real,
pinned servers: docs/benchmarks.md has them)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from jaxcpp.serving import Client
from tests.serving.fakes import fake_engine

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "disaggregation.py"
_spec = importlib.util.spec_from_file_location("benchmark_disaggregation", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def args(*argv: str) -> argparse.Namespace:
    return bench.build_parser().parse_args(["--streams", "6", "--stream-input-len", "8", "--stream-output-len", "5",
                                            "--long-prompt-len", "100", "--long-output-len", "2", "--inject-at", "0",
                                            "--inject-every", "0.05", "--inject-until", "0.24", *argv])


def test_the_split_gives_each_engine_half_the_streams_and_every_other_long_prompt() -> None:
    specs = bench.workload(args(), vocab_size=64, eos={1}, seed=3)
    streams = [s for s in specs if s.send_at is None]
    longs = [s for s in specs if s.send_at is not None]
    assert [len(s.prompt) for s in streams] == [8] * 6 and {s.output_len for s in streams} == {5}
    assert [round(t, 6) for t in sorted(s.send_at for s in longs)] == [0.0, 0.05, 0.1, 0.15, 0.2]
    assert all(len(s.prompt) == 100 and 1 not in s.prompt for s in longs)
    where = bench.split(specs, 2)
    assert [w for s, w in zip(specs, where, strict=True) if s.send_at is None] == [0, 1, 0, 1, 0, 1]
    by_time = sorted((s.send_at, w) for s, w in zip(specs, where, strict=True) if s.send_at is not None)
    assert [w for _, w in by_time] == [0, 1, 0, 1, 0]
    assert bench.split(specs, 1) == [0] * len(specs)


def test_drive_sends_each_request_to_its_engine(serve: Any) -> None:
    # slow steps: the streams outlast the long prompts' send times (0 to 4 ms), so all five are sent
    servers = [serve(fake_engine(max_model_len=1024, step_delay_s=0.01)) for _ in range(2)]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    specs = bench.workload(args("--inject-every", "0.001", "--inject-until", "0.0045"), vocab_size=64, eos={1},
                           seed=0)
    results, sent_to, duration = asyncio.run(bench.drive(targets, specs, bench.split(specs, 2)))
    s = bench.summarize(results, duration)
    assert (s["completed"], s["failed"], s["num_long_prompts"]) == (11, 0, 5)
    assert s["total_output_tokens"] == 6 * 5 + 5 * 2 and s["stream_throughput"] > 0
    assert sorted((r.kind, w) for r, w in zip(results, sent_to, strict=True)) == sorted(
        [("normal", 0)] * 3 + [("normal", 1)] * 3 + [("long", 0)] * 3 + [("long", 1)] * 2)
    generated = []
    for target in targets:
        with Client(target) as c:
            generated.append(c.stats().engine.num_generation_tokens_total)
    assert generated == [3 * 5 + 3 * 2, 3 * 5 + 2 * 2]


def test_long_prompts_stop_when_the_streams_end(serve: Any) -> None:
    server = serve(fake_engine(max_model_len=1024, step_delay_s=0.01))
    specs = bench.workload(args("--inject-every", "0.05", "--inject-until", "10"), vocab_size=64, eos={1}, seed=0)
    assert sum(s.kind == "long" for s in specs) == 200
    results, _, duration = asyncio.run(bench.drive([f"127.0.0.1:{server.port}"], specs, [0] * len(specs)))
    longs = [r for r in results if r.kind == "long"]
    streams_end = max(r.start + r.e2el for r in results if r.kind == "normal")
    # Injections alone would go on for 10 s: ending in half that is the streams' end stopping them (a
    # bound on the behaviour, not on this machine's speed: the streams take well under a second idle).
    assert 1 <= len(longs) < 20 and duration < 10 / 2
    assert all(r.success and r.start <= streams_end for r in longs)


def test_itl_attribution_splits_the_gaps_by_their_engine_s_long_prompts() -> None:
    R = bench.serving.RequestResult
    results = [R("long", 100, 1.0, True, output_len=1, ttft=0.5),
               R("normal", 8, 0.5, True, output_len=5, token_times=[0.5, 0.9, 1.2, 1.6, 1.7]),
               R("normal", 8, 1.1, True, output_len=2, token_times=[1.1, 1.3])]
    x = bench.itl_attribution(results, [0, 0, 1])
    # target 0's stream: (0.9, 1.2) and (1.2, 1.6) overlap the window [1.0, 1.5], the second holds its end;
    # target 1's stream is outside: the long prompt ran on the other engine
    assert (x["during_n"], x["outside_n"], x["admitting_n"]) == (2, 3, 1)
    assert round(x["during_p50"], 6) == 350.0 and round(x["admitting_p50"], 6) == 400.0
    assert round(x["outside_p50"], 6) == 200.0


def test_kv_bytes_per_token_is_the_layout_unpadded(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "num_key_value_heads": 2,
                                                      "hidden_size": 256, "num_attention_heads": 8}))
    assert bench.kv_bytes_per_token(str(tmp_path), "float32") == 2 * 8 * 2 * 32 * 4
    assert bench.kv_bytes_per_token(str(tmp_path), "float8_e4m3fn") == 2 * 8 * 2 * 32


def _run(itl_p99: float, throughput: float) -> dict[str, Any]:
    summary = {"itl_ms": {"p50": 5.0, "p99": itl_p99, "max": 2 * itl_p99}, "ttft_ms": {"p50": 10.0, "p99": 20.0},
               "long_prompt_ttft_ms": {"p50": 300.0, "p99": 400.0}, "stream_throughput": throughput, "failed": 0}
    return {"summary": summary}


def test_the_table_gives_medians_and_the_ratios_of_the_targets() -> None:
    runs = {"colocated": [_run(50, 1000), _run(40, 900), _run(60, 1100)],
            "disaggregated": [_run(10, 900), _run(8, 950), _run(20, 800)]}
    text = bench.compare_table(runs)
    assert "| colocated | 5.0 ms | 50.0 ms | 100 ms |" in text and "| 1000 |" in text
    assert ("with the long prompts: p99 ITL colocated / disaggregated: 5.00x (per run pair: 5.00, 5.00, 3.00); "
            "output throughput disaggregated / colocated: 0.90x (per run pair: 0.90, 1.06, 0.73)") in text
    runs |= {"colocated, streams only": [_run(20, 1000)], "disaggregated, streams only": [_run(10, 500)]}
    assert ("streams only: p99 ITL colocated / disaggregated: 2.00x (per run pair: 2.00); output throughput "
            "disaggregated / colocated: 0.50x (per run pair: 0.50)") in bench.compare_table(runs)


def test_a_long_prompt_s_ttft_is_split_into_producer_pull_and_consumer() -> None:
    R = bench.serving.RequestResult
    results = [R("long", 1536, 1.0, True, output_len=4, ttft=0.5), R("long", 1536, 2.0, True, output_len=4, ttft=0.7),
               R("normal", 8, 0.0, True, output_len=9, ttft=0.1)]
    counts = {"num_kv_transfers_total": 2, "num_remote_prefill_microseconds_total": 800_000,
              "num_kv_transfer_microseconds_total": 40_000, "num_kv_transfer_bytes_total": 4096 * 2 * 2048,
              "num_kv_transfer_tokens_total": 2 * 1536}
    t = bench.long_prompt_times(results, counts, (0.7, 2))
    assert (t["n"], round(t["client_ttft_ms"], 6), t["producer_call_ms"], t["pull_ms"]) == (2, 600.0, 400.0, 20.0)
    assert round(t["consumer_rest_ms"], 6) == 180.0 and round(t["producer_ttft_ms"], 6) == 350.0
    assert round(t["bytes_per_token"], 3) == round(4096 * 2048 / 1536, 3)  # 96 pages padded to 128
    assert bench.long_prompt_times(results, {**counts, "num_kv_transfers_total": 3}, (0.7, 2)) == {}
