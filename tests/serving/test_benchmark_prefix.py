"""benchmarks/serving.py's prefix-caching workloads against a fake-engine server: a shared system prompt
is served from the cache after its first request, and each chat turn resends the whole history."""

from __future__ import annotations

import argparse

from tests.serving.fakes import fake_engine
from tests.serving.test_benchmark import bench


def args(**kw) -> argparse.Namespace:
    base = dict(api_key=None, seed=0, num_prompts=6, shared_prefix_len=64, random_input_len=8, random_output_len=4,
                request_rate=float("inf"), burstiness=1.0, max_concurrency=1, num_conversations=2, num_turns=3,
                turn_input_len=20, percentiles=[99])
    return argparse.Namespace(**{**base, **kw})


def test_shared_prefix_workload_hits_the_cache(serve) -> None:
    server = serve(fake_engine(max_model_len=1024))
    row = bench.run_prefix_workload(args(), f"127.0.0.1:{server.port}", "shared-prefix")
    assert row["summary"]["completed"] == 6
    # One at a time: the first computes the 64-token prompt, the other five take its four pages.
    assert row["cached_tokens_per_request"] == [0] + [64] * 5
    assert (row["queried_tokens"], row["hit_tokens"]) == (6 * 72, 5 * 64)


def test_multi_turn_resends_the_history(serve) -> None:
    server = serve(fake_engine(max_model_len=1024))
    row = bench.run_prefix_workload(args(), f"127.0.0.1:{server.port}", "multi-turn")
    s = row["summary"]
    assert s["completed"] == 6 and s["total_input_tokens"] == 2 * (20 + 44 + 68)  # + 4 replied + 20 each turn
    assert row["hit_tokens"] > 0 and row["cached_tokens_per_request"].count(0) >= 2  # first turns miss
    table = bench.prefix_table([{**row, "caching": "on"}])
    assert "| multi-turn | on |" in table
