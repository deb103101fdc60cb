"""Flags whose behaviour README.md and the help describe, checked as described: how memory becomes KV
pages, the --max-model-len default and its errors, the deprecated --block-size, the smooth factor's
environment variable, and --seed for requests that bring none. Host only (the model folder's
config.json, no weights, or the fake executor)."""

from __future__ import annotations

import pytest

from jaxcpp.cli_args import engine_config_from_args
from jaxcpp.config import DEFAULT_SMOOTH_FACTOR, ConfigError, EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.fake_executor import FakeExecutor
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.models.spec import resolve_model_spec
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.cli import build_parser

TINY_PAGE_BYTES = 2 * 4 * 16 * 2 * 32 * 4  # K and V, 4 layers, 16 tokens, 2 KV heads, head_dim 32, float32


def plan(**flags) -> EngineSizing:
    return EngineSizing.plan(EngineConfig.from_kwargs(**{"model": "tiny", **flags}),
                             resolve_model_spec("tiny", "float32"))


def test_kv_cache_memory_becomes_pages_capped_at_what_max_num_seqs_can_use() -> None:
    memory_gb = 40 * TINY_PAGE_BYTES / 2**30  # room for exactly 40 pages
    assert plan(kv_cache_memory_gb=memory_gb, max_model_len=256).num_pages == 40
    # 1 GB would hold 32768 pages; 4 sequences of 256 tokens use 4 x 16, plus the reserved page
    assert plan(kv_cache_memory_gb=1.0, max_model_len=256, max_num_seqs=4).num_pages == 4 * 16 + 1
    assert plan(num_pages=50, kv_cache_memory_gb=1.0, max_model_len=256).num_pages == 50  # given: as is


def test_too_little_kv_memory_or_too_few_pages_for_one_sequence_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--num-pages: 16 pages cannot hold one sequence of --max-model-len "
                                          r"\(16 pages of 16 tokens, plus the reserved page\)"):
        plan(num_pages=16, max_model_len=256)
    with pytest.raises(ConfigError, match="--num-pages: 10 pages cannot hold one sequence"):
        plan(kv_cache_memory_gb=10 * TINY_PAGE_BYTES / 2**30, max_model_len=256)


def test_max_model_len_defaults_to_the_models_and_may_not_exceed_it() -> None:
    assert plan().max_model_len == 2048  # the tiny model's max_position_embeddings
    with pytest.raises(ConfigError, match="--max-model-len: 4096 exceeds the model's max_position_embeddings 2048"):
        plan(max_model_len=4096)


def test_block_size_is_page_size_with_a_warning_on_the_command_line_and_in_python(capsys) -> None:
    args = build_parser().parse_args(["serve", "--block-size", "32"])
    assert engine_config_from_args(args).cache.page_size == 32
    assert capsys.readouterr().err == "jaxcpp serve: warning: --block-size is deprecated: use --page-size\n"
    with pytest.warns(FutureWarning, match="--block-size is deprecated: use --page-size"):
        assert EngineConfig.from_kwargs(block_size=32).cache.page_size == 32


def test_the_smooth_factor_defaults_to_its_environment_variable(monkeypatch) -> None:
    """On the command line; the dataclass itself reads no environment (config/__init__.py)."""
    monkeypatch.setenv("JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "0.3")
    assert EngineConfig().chunking.dynamic_chunking_smooth_factor == DEFAULT_SMOOTH_FACTOR
    assert engine_config_from_args(build_parser().parse_args(["serve"])).chunking.dynamic_chunking_smooth_factor == 0.3
    flag = build_parser().parse_args(["serve", "--dynamic-chunking-smooth-factor", "0.9"])
    assert engine_config_from_args(flag).chunking.dynamic_chunking_smooth_factor == 0.9  # the flag wins
    monkeypatch.setenv("JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "lots")
    with pytest.raises(ConfigError, match="JAXCPP_DYNAMIC_CHUNKING_SMOOTH_FACTOR: expected a number, got 'lots'"):
        engine_config_from_args(build_parser().parse_args(["serve"]))


def test_seed_draws_the_seeds_of_requests_that_bring_none() -> None:
    def seeds(seed: int, request_seed: int | None = None) -> list[int]:
        config = EngineConfig.from_kwargs(model="tiny", max_model_len=256, max_num_batched_tokens=64,
                                          log_stats_interval_s=0, seed=seed)
        engine = LLMEngine(config, executor=FakeExecutor())
        for i in range(3):
            engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1, seed=request_seed))
        engine.step()
        return engine.executor.steps[0].seeds[:3].tolist()  # type: ignore[attr-defined]

    assert seeds(1) == seeds(1)                   # reproducible from --seed
    assert seeds(1) != seeds(2) and len(set(seeds(1))) == 3  # a different --seed, distinct per request
    assert seeds(1, request_seed=7) == seeds(2, request_seed=7) == [7, 7, 7]  # a request's own seed wins
