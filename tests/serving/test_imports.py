"""Serving never imports jax: a client machine needs only grpc, and `jaxcpp client` starts fast."""

from __future__ import annotations

import subprocess
import sys


def test_serving_modules_do_not_import_jax() -> None:
    code = ("import sys, jaxcpp.serving, jaxcpp.serving.client, jaxcpp.serving.server, "
            "jaxcpp.serving.cli, jaxcpp.serving.metrics, jaxcpp.serving.engine_loop; "
            "from jaxcpp.serving import Client, AsyncClient, ClientError; "
            "from jaxcpp.serving.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_import_jaxcpp_serving_is_light() -> None:
    code = "import sys, jaxcpp.serving; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
