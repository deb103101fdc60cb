"""The engine loop's own time, phase by phase, for the trace (`HostPhase`). No jax."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from jaxcpp.core.executor import HostPhase
from jaxcpp.core.gc_heap import GcWatch


class PhaseRecorder:
    """The engine loop's own time, phase by phase (`HostPhase`), handed to the executor's trace, and the
    garbage collector's pauses as phase "gc" of the step being timed (every thread waits for those)."""

    def __init__(self) -> None:
        self._done: list[HostPhase] = []
        self._step = 0
        self._gc = GcWatch(lambda start, end: self._done.append(HostPhase("gc", self._step, start, end)))

    def timer(self, step: int) -> Callable[[str], AbstractContextManager[None]]:
        """`with timer("build"): ...` records that phase of step `step`."""
        self._step = step

        @contextmanager
        def phase(name: str) -> Iterator[None]:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._done.append(HostPhase(name, step, start, time.perf_counter()))

        return phase

    def take(self) -> list[HostPhase]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._gc.close()
