"""Prefix caching as the API shows it: `num_cached_tokens` on the final stream message, the hit counters
and cached pages in GetServerStats and Prometheus, and the --[no-]enable-prefix-caching flag. The real
engine on the fake executor (page size 16)."""

from __future__ import annotations

import argparse
import urllib.request

from jaxcpp.cli_args import add_engine_args, engine_config_from_args
from jaxcpp.serving import Client
from tests.serving.fakes import fake_engine

PROMPT = list(range(40, 90))  # 50 tokens: three whole pages, the last token on a fourth


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_hit_rate(serve) -> None:
    server = serve(fake_engine(), metrics_port=0)
    with Client(f"127.0.0.1:{server.port}") as client:
        first = client.generate(PROMPT, max_tokens=4, temperature=0)
        second = list(client.stream(PROMPT, max_tokens=4, temperature=0))
        stats = client.stats()
    assert first.num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 48 and all(d.num_cached_tokens == 0 for d in second[:-1])
    assert [t for d in second for t in d.token_ids] == first.token_ids
    engine = stats.engine
    assert (engine.num_prefix_cache_queried_tokens_total, engine.num_prefix_cache_hit_tokens_total) == (100, 48)
    assert engine.prefix_cache_hit_rate == 0.48
    assert engine.num_pages_cached == 3 and engine.num_prefix_cache_evictions_total == 0
    assert engine.num_pages_used == 0 and engine.num_pages_free == engine.num_pages_total
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    for line in ("jaxcpp_prefix_cache_queries_total 100.0", "jaxcpp_prefix_cache_hits_total 48.0",
                 "jaxcpp_prefix_cache_hit_rate 0.48", "jaxcpp_kv_cache_pages_cached 3.0",
                 "jaxcpp_prefix_cache_evictions_total 0.0"):
        assert line in body, line


def test_with_prefix_caching_off_nothing_is_cached(serve) -> None:
    server = serve(fake_engine(enable_prefix_caching=False))
    with Client(f"127.0.0.1:{server.port}") as client:
        outs = [client.generate(PROMPT, max_tokens=2, temperature=0) for _ in range(2)]
        stats = client.stats()
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert stats.engine.num_prefix_cache_hit_tokens_total == 0 and stats.engine.num_pages_cached == 0


def test_the_flag_is_on_by_default_and_can_be_turned_off() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).cache.enable_prefix_caching is True
    off = engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"]))
    assert off.cache.enable_prefix_caching is False
