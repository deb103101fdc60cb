"""Packaging: the wheel carries the bundled checkpoint, the proto and the CPU decode kernel's source, and
setuptools builds it quietly."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "jaxcpp", "models", "kernels", "serving")


@pytest.mark.slow  # one wheel build, ~10 s
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_wheel_builds_without_package_data_warnings(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy, so the build writes no build/ or egg-info into the checkout
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "would be ignored" not in output and "absent from the `packages` configuration" not in output, output
    wheel = next((tmp_path / "dist").glob("jaxcpp-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "jaxcpp/models/checkpoints/tiny/config.json" in names
    assert "jaxcpp/serving/proto/jaxcpp/v1/jaxcpp.proto" in names
    assert "jaxcpp/kernels/paged_attention_cpu.cc" in names  # built on first use on CPU


@pytest.mark.parametrize("name", ["kernels", "models"])
def test_checkout_folders_do_not_shadow_installed_top_level_names(name: str) -> None:
    """An installed distribution's top-level module (transformers 5 imports Hugging Face's `kernels`) wins
    over the checkout's folder of that name, which is only ever imported as `jaxcpp.<name>`."""
    import importlib.metadata

    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"no distribution named {name!r} is installed")
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent != REPO / name, spec.origin
