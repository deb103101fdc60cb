"""One place that shapes the test process: 8 JAX host devices (PP=4 x TP=2 meshes) and float32 matmuls at
full precision, set before anything imports jax; and the checkout's root moved to the end of sys.path.

`python -m pytest` puts the checkout's root first on sys.path, and there its folders `kernels/` and
`models/` (installed as `jaxcpp.kernels`, `jaxcpp.models`) would shadow installed distributions of the
same top-level names: transformers 5 imports Hugging Face's `kernels` package at import time and found
ours instead ("cannot import name 'CUDAProperties' from 'kernels'")."""

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

_REPO = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _REPO] + [_REPO]
