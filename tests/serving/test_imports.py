"""`import jaxcpp.serving` is light, so `jaxcpp client` starts fast (that serving imports no jax at all is
tests/test_architecture.py's walk)."""

from __future__ import annotations

import subprocess
import sys


def test_import_jaxcpp_serving_is_light() -> None:
    code = "import sys, jaxcpp.serving; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
