"""The stage watchers (jaxcpp.runtime.timing) and the end of the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A watcher blocked in jax.block_until_ready when the main thread returns. Without the watchers being
# stopped at exit, the interpreter cuts the daemon thread off inside C++ and the process aborts
# ("FATAL: exception not rethrown", SIGABRT) after all its work is done: the way `jaxcpp generate`
# died once in CI.
_EXIT_WHILE_WATCHING = textwrap.dedent("""
    import time
    import jax
    import jax.numpy as jnp
    from jaxcpp.runtime.timing import DispatchedStage, TimingRecorder

    @jax.jit
    def slow(x):
        for _ in range(40):
            x = jnp.tanh(x @ x)
        return x

    x = jnp.full((1024, 1024), 0.001, jnp.float32)
    slow(x).block_until_ready()  # compiled before the timed part
    recorder = TimingRecorder(1)
    out = slow(x)
    recorder.watch([DispatchedStage(0, 0, 1024, ack=False, traced=False, dispatched=time.perf_counter(),
                                    inputs=x, output=out)])
    time.sleep(0.02)  # the watcher is inside block_until_ready now
    print("still computing at exit:", not out.is_ready(), flush=True)
""")


def test_a_process_that_never_closes_its_recorder_exits_cleanly_while_a_watcher_waits() -> None:
    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_WATCHING], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr:\n{proc.stderr[-2000:]}"
    assert "still computing at exit: True" in proc.stdout, "the watcher was not waiting at exit: no test"
