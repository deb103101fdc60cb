"""Counts XLA compilations, so the engine can report and tests can forbid any after warm-up.

Every jit cache miss lowers a new program, and lowering records a JAX monitoring event; counting those
events catches every new program, including ones a persistent compilation cache then serves from disk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax import monitoring

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration_secs: float, **kwargs: object) -> None:
    global _count
    if event == _LOWERING_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def num_compilations() -> int:
    """Programs lowered in this process since `install()`."""
    return _count


class CompileAfterWarmupError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_compile() -> Iterator[None]:
    """Fail if anything inside the block compiles (tpu-inference calls theirs ForbidCompile)."""
    install()
    before = num_compilations()
    yield
    compiled = num_compilations() - before
    if compiled:
        raise CompileAfterWarmupError(f"{compiled} program(s) compiled inside a forbid_compile() block")
