"""Where the persistent XLA compilation cache goes: JAXCPP_COMPILATION_CACHE_DIR (empty: none), else
$XDG_CACHE_HOME/jaxcpp/xla, else ~/.cache/jaxcpp/xla, as README.md says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcpp.runtime.stage_ops import compilation_cache_dir


def test_the_cache_folder_follows_the_variables() -> None:
    home = os.path.expanduser("~")
    assert compilation_cache_dir({}) == os.path.join(home, ".cache", "jaxcpp", "xla")
    assert compilation_cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == "/x/cache/jaxcpp/xla"
    assert compilation_cache_dir({"XDG_CACHE_HOME": ""}) == os.path.join(home, ".cache", "jaxcpp", "xla")
    assert compilation_cache_dir({"XDG_CACHE_HOME": "/x", "JAXCPP_COMPILATION_CACHE_DIR": "/y"}) == "/y"
    assert compilation_cache_dir({"XDG_CACHE_HOME": "/x", "JAXCPP_COMPILATION_CACHE_DIR": ""}) is None


@pytest.mark.slow  # one `jaxcpp generate` compiling its two programs on an empty cache
def test_generate_writes_its_programs_under_xdg_cache_home_and_nothing_in_home(tmp_path: Path) -> None:
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAXCPP_COMPILATION_CACHE_DIR"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(xdg))
    cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "generate", "--prompt-token-ids", "1,2,3",
           "--max-tokens", "2", "--max-model-len", "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
           "--log-level", "warning"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr:\n{proc.stderr[-2000:]}"
    assert any((xdg / "jaxcpp" / "xla").iterdir()), "no program was cached under XDG_CACHE_HOME"
    assert not (home / ".cache" / "jaxcpp").exists()
