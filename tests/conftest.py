"""One place that shapes the JAX CPU backend for every test: 8 host devices (PP=4 x TP=2 meshes)
and float32 matmuls at full precision, set before anything imports jax."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
