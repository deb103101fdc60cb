"""Engine fixtures: the bundled tiny model, run in float32 so chunked and unchunked runs match to 1e-5."""

from __future__ import annotations

import os

import pytest

MODEL = os.environ.get("JAXCPP_TEST_MODEL", "tiny")


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL


def _make_llm(**kwargs):
    from jaxcpp import LLM

    defaults = dict(model=MODEL, dtype="float32", max_model_len=1024, log_stats_interval_s=0,
                    record_logits=True)
    return LLM(**{**defaults, **kwargs})


@pytest.fixture(scope="session")
def make_llm():
    """Factory for offline engines on the test model; keyword arguments are engine flags."""
    return _make_llm
