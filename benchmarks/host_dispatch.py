"""Where the engine thread's dispatch of a decode step goes, and what the step's neighbours cost it.

The bundled model, 64 prompts of 16 tokens, 256 greedy tokens each (the decode-heavy batch against
Hugging Face): each piece of `PipelineExecutor.submit` and `collect` timed on the engine thread over
one generate after a warm one (medians, microseconds). Then two controls on the same machine: jax's
host-to-device calls back to back, and one at a time on a quiet machine, while a program keeps XLA:CPU's
pool busy on every core (what the engine thread meets: async scheduling dispatches step k+1 while step k
runs) and just after one ended; and the machine's memory read rate (the bound of the decode attention's
K/V reads).

    .venv/bin/python -P benchmarks/host_dispatch.py
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def timed(acc: dict[str, list[float]], obj: Any, name: str, label: str) -> None:
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        acc[label].append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def dispatch_pieces() -> None:
    from jaxcpp import LLM, SamplingParams

    llm = LLM(model="tiny", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=64, log_stats_interval_s=0)
    executor, stage = llm.engine.executor, llm.engine.executor.stages[0]  # type: ignore[attr-defined]
    acc: dict[str, list[float]] = defaultdict(list)
    timed(acc, executor, "submit", "submit")
    timed(acc, executor, "_put_step", "  pack + put on the stage")
    timed(acc, executor, "_fed_back", "  fed-back tokens")
    timed(acc, stage, "_program", "  forward program call")
    timed(acc, stage, "sample", "  sampler call")
    timed(acc, executor, "_fetch", "  copy_to_host_async")
    timed(acc, executor, "collect", "collect (waits for the step)")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(16)] for _ in range(64)]
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm
    acc.clear()
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    print(f"generate {time.perf_counter() - start:.3f} s, {len(acc['submit'])} steps; engine thread, median us:")
    for label, seconds in acc.items():
        print(f"  {label:32s} {statistics.median(seconds) * 1e6:8.1f}")
    llm.close()


def host_call_costs() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("pp", "tp")), P())
    host = np.zeros(3000, np.int32)  # a 64-row decode step's packed inputs are ~12 KB
    on_device = jax.device_put(host, sharding)
    identity = jax.jit(lambda x: x, in_shardings=sharding, out_shardings=sharding)
    calls: dict[str, Callable[[], Any]] = {
        "jax.device_put(host array)": lambda: jax.device_put(host, sharding),
        "jax.device_put(array already there)": lambda: jax.device_put(on_device, sharding),
        "jitted identity(host array)": lambda: identity(host),
        "np.concatenate of two 12 KB arrays": lambda: np.concatenate([host, host]),
    }
    big = jnp.ones((2048, 2048), jnp.float32)
    busy = jax.jit(lambda a: (a @ a @ a @ a).sum())
    busy(big).block_until_ready()
    print("host calls, median us: back to back / machine quiet / while a program runs on XLA:CPU's pool / "
          "just after it ended")
    for label, call in calls.items():
        call()
        hot = [_seconds(call) for _ in range(200)]
        quiet, beside, after = [], [], []
        for _ in range(30):
            time.sleep(0.05)  # the pool's threads idle (they spin a while after their last work)
            quiet.append(_seconds(call))
            running = busy(big)  # dispatched asynchronously: it runs while the call below does
            time.sleep(0.002)
            beside.append(_seconds(call))
            running.block_until_ready()
            after.append(_seconds(call))
        print(f"  {label:38s} " + " / ".join(f"{statistics.median(x) * 1e6:7.1f}" for x in (hot, quiet, beside, after)))


def _seconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def memory_read_rate() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = 128 * 1024 * 1024  # 512 MB of float32: far beyond any cache
    on_device, host = jnp.ones((n,), jnp.float32), np.ones(n, np.float32)
    total = jax.jit(lambda a: a.reshape(16, -1).sum(1))
    total(on_device).block_until_ready()
    runs: dict[str, Callable[[], Any]] = {"XLA:CPU sum, its pool": lambda: total(on_device).block_until_ready(),
                                          "numpy sum, one core": host.sum}
    for label, run in runs.items():
        seconds = statistics.median(_seconds(run) for _ in range(5))
        print(f"memory read, {label}: {n * 4 / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    dispatch_pieces()
    host_call_costs()
    memory_read_rate()
