"""The small host pieces behave (that host modules import no jax is tests/test_architecture.py's walk)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxcpp.config import EngineConfig
from jaxcpp.core.buckets import pad_to_bucket, token_buckets
from jaxcpp.core.page_allocator import PageAllocator
from jaxcpp.core.sizing import EngineSizing, dtype_on_backend
from jaxcpp.models.spec import resolve_model_spec


def test_dtype_auto_is_float32_on_cpu_only():
    assert dtype_on_backend("auto", "cpu") == "float32"
    assert dtype_on_backend("auto", "gpu") == "auto" and dtype_on_backend("bfloat16", "cpu") == "bfloat16"


def test_sizing_crosses_the_wire_unchanged():
    """What a multi-process head sends its stages (JSON) rebuilds the head's sizing exactly."""
    config = EngineConfig.from_kwargs(model="tiny", dtype="float32", max_model_len=256, page_size=16)
    sizing = EngineSizing.plan(config, resolve_model_spec("tiny", "float32"))
    back = EngineSizing.from_message(json.loads(json.dumps(sizing.to_message())), resolve_model_spec("tiny", "auto"))
    assert back.spec.config == sizing.spec.config
    assert dataclasses.replace(back, spec=sizing.spec) == sizing


def test_buckets_are_aligned_and_bounded():
    for budget, page in [(512, 16), (4096, 16), (32768, 128), (100, 64)]:
        buckets = token_buckets(budget, page)
        align = max(64, page)
        assert all(b % align == 0 for b in buckets)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= budget
        for n in range(1, budget + 1, 37):
            padded = pad_to_bucket(n, buckets)
            assert padded >= n and (padded - n < align or (padded - n) / n <= 0.25)
    assert len(token_buckets(32768, 64)) < 64


def test_page_allocator_reserves_page_zero_and_counts_refs():
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    assert 0 not in pages and alloc.num_free == 0
    alloc.free(pages[1:])
    assert alloc.num_free == 2
    alloc.free(pages[:1])
    assert alloc.num_free == 3
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(pages[:1])
    with pytest.raises(RuntimeError):
        alloc.allocate(4)
