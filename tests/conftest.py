"""One place that shapes the test process: 8 JAX host devices (PP=4 x TP=2 meshes) and float32 matmuls at
full precision, set before anything imports jax; the checkout's root moved to the end of sys.path; and
jax's compiled programs dropped after every test module (below).

`python -m pytest` puts the checkout's root first on sys.path, and there its folders `kernels/` and
`models/` (installed as `jaxcpp.kernels`, `jaxcpp.models`) would shadow installed distributions of the
same top-level names: transformers 5 imports Hugging Face's `kernels` package at import time and found
ours instead ("cannot import name 'CUDAProperties' from 'kernels'")."""

import gc
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

_REPO = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _REPO] + [_REPO]


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """After each module, drop every program jax keeps compiled. XLA:CPU maps each JIT-compiled kernel
    into the process (about three memory mappings a kernel), jax's caches keep a program after its
    engine is gone, and the whole suite builds hundreds of engines in one process: left alone it
    passed the kernel's limit of 65,530 mappings (`vm.max_map_count`), and the next compile died with a
    segmentation fault inside XLA. So no engine outlives its module (the engine fixtures are
    module-scoped), and each module starts with an empty in-memory cache (the persistent one stays)."""
    yield
    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
