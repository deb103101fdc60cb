"""--attention-backend selection: which function each choice yields on CPU, and the ROCm launch switch."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import pytest

from jaxcpp.kernels import backend
from jaxcpp.kernels.mla_attention import mla_absorbed_attention, mla_absorbed_xla, mla_prefill_rebuilt_xla
from jaxcpp.kernels.mla_rebuilt import mla_prefill_rebuilt_attention
from jaxcpp.kernels.ragged_paged_attention import (
    ROCM_LAUNCH,
    ragged_paged_attention,
    ragged_paged_attention_xla,
)

ON_CPU = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the choice off a GPU")


@ON_CPU
def test_auto_and_xla_pick_the_xla_path_on_cpu():
    assert backend.select_attention("auto") is ragged_paged_attention_xla
    assert backend.select_attention("xla") is ragged_paged_attention_xla


@ON_CPU
def test_mla_absorbed_form_follows_the_same_rule():
    assert backend.select_mla_absorbed("auto") is mla_absorbed_xla
    assert backend.select_mla_absorbed("xla") is mla_absorbed_xla
    fn = backend.select_mla_absorbed("pallas")
    assert isinstance(fn, functools.partial) and fn.func is mla_absorbed_attention
    assert fn.keywords == {"interpret": True}
    with pytest.raises(ValueError, match="--attention-backend"):
        backend.select_mla_absorbed("triton")


@ON_CPU
def test_mla_rebuilt_form_follows_the_same_rule():
    assert backend.select_mla_rebuilt("auto") is mla_prefill_rebuilt_xla
    assert backend.select_mla_rebuilt("xla") is mla_prefill_rebuilt_xla
    fn = backend.select_mla_rebuilt("pallas")
    assert isinstance(fn, functools.partial) and fn.func is mla_prefill_rebuilt_attention
    assert fn.keywords == {"interpret": True}
    with pytest.raises(ValueError, match="--attention-backend"):
        backend.select_mla_rebuilt("triton")


@ON_CPU
def test_pallas_on_cpu_interprets():
    fn = backend.select_attention("pallas")
    assert isinstance(fn, functools.partial) and fn.func is ragged_paged_attention
    assert fn.keywords == {"interpret": True}


def test_unknown_backend_names_the_flag():
    with pytest.raises(ValueError, match="--attention-backend"):
        backend.select_attention("triton")


@pytest.mark.parametrize(
    ("platform", "platform_version", "rocm"),
    [("gpu", "rocm 6.3.1", True),   # told by the client's version string
     ("rocm", "", True),            # told by the device's platform, as ROCm builds of jaxlib name it
     ("gpu", "cuda 12.8", False)],
)
def test_gpu_selects_compiled_pallas_with_vendor_launch(monkeypatch, platform, platform_version, rocm):
    device = SimpleNamespace(platform=platform, client=SimpleNamespace(platform_version=platform_version))
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(backend.jax, "devices", lambda *a: [device])
    assert backend.is_rocm() is rocm
    assert backend.resolve_backend("auto") == "pallas"
    fn = backend.select_attention("auto")
    assert fn.func is ragged_paged_attention
    assert fn.keywords == {"interpret": False, **(ROCM_LAUNCH if rocm else {})}
    mla = backend.select_mla_absorbed("auto")
    assert mla.func is mla_absorbed_attention and mla.keywords == {"interpret": False}
    rebuilt = backend.select_mla_rebuilt("auto")
    assert rebuilt.func is mla_prefill_rebuilt_attention and rebuilt.keywords == {"interpret": False}
