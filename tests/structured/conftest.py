"""Structured-output fixtures: small engines on the bundled tiny model (byte-level: a grammar over bytes)."""

from __future__ import annotations

import pytest

SMALL = dict(model="tiny", dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
             page_size=16, log_stats_interval_s=0)


@pytest.fixture(scope="module")
def small_llm():
    """One engine per configuration for the module (each compiles its programs; no engine outlives its
    module: tests/conftest.py drops the compiled programs after each)."""
    from jaxcpp import LLM

    engines: dict[tuple, LLM] = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in engines:
            engines[key] = LLM(**{**SMALL, **kwargs})
        return engines[key]

    yield get
    for llm in engines.values():
        llm.engine.close()
