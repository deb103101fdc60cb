"""Every test runs under a time limit (pytest-timeout, pyproject.toml): a test that hangs, as a loop on
`engine.has_unfinished_requests()` would if a request never finished, fails instead of stalling CI."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_suite_sets_a_per_test_timeout() -> None:
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 60 <= int(options["timeout"]) <= 1800


def test_a_hanging_test_fails_within_its_limit(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text("def test_never_ends():\n    while True:\n        pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                             "-o", "timeout=2", str(tmp_path / "test_hang.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "Timeout" in result.stdout and "1 failed" in result.stdout, result.stdout[-2000:]
