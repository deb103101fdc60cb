"""How much two processes computing at once get on this machine, with no jaxcpp in it: a jitted
1024 x 1024 matmul loop, single-threaded XLA:CPU, pinned to one core, for 8 s.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/two_core_check.py 0                 # alone
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/two_core_check.py 0 & \\
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/two_core_check.py 1                 # both at once

The two-at-once sum over the alone figure caps what two pipeline stages can gain here.
"""

import os
import sys
import time

os.sched_setaffinity(0, [int(sys.argv[1])])
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

x = jnp.ones((1024, 1024))
step = jax.jit(lambda a: (a @ a) * 1e-3)
step(x).block_until_ready()
t0, n = time.perf_counter(), 0
while time.perf_counter() - t0 < 8:
    x = step(x)
    x.block_until_ready()
    n += 1
print(f"core {sys.argv[1]}: {n / (time.perf_counter() - t0) * 2 * 1024**3 / 1e9:.1f} GFLOP/s")
