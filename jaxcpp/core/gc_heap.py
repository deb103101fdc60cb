"""The garbage collector and the engine loop: freeze what start-up left, show the pauses (no jax).

CPython's full collection (generation 2) walks every object the collector tracks, and it stops every
thread while it does. After an engine's start-up that is everything jax, flax, grpc and the traced,
lowered and compiled programs keep alive: ~170k objects for the bundled model, one full pass 90-300 ms
on the development machine. Serving allocates enough to trigger such a pass every few seconds to
minutes, and each one stalled every stream for its whole length (a lone 100-300 ms inter-token
latency in a run whose steps take 10 ms).

    seconds = freeze_startup_heap()  # after warm-up: collect once, then move every object alive into
                                     # the permanent generation (`gc.freeze`, as vLLM does after its
                                     # start-up): later passes walk only what serving allocated
    thaw()                           # on close: the frozen objects become collectable again
    watch = GcWatch(on_pause)        # on_pause(start, end) for every pass over `min_pause_s`
    watch.close()

A frozen object is never collected: cyclic garbage among them stays until `thaw()`. Objects freed by
reference counting (most of them) go as usual.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

MIN_PAUSE_S = 1e-3  # passes shorter than this are routine (generation 0, every ~700 allocations)


def freeze_startup_heap() -> float:
    """Collect, then freeze every object alive; returns the seconds it took. Repeated calls refreeze
    (a second engine's start-up also collects what an earlier, closed one left)."""
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


def thaw() -> None:
    """Undo `freeze_startup_heap`: the next full pass may collect what was frozen."""
    gc.unfreeze()


class GcWatch:
    """Calls `on_pause(start, end)` (perf_counter seconds) after every collection of at least
    `min_pause_s`, on whichever thread ran it: every thread waited for it."""

    def __init__(self, on_pause: Callable[[float, float], None], min_pause_s: float = MIN_PAUSE_S) -> None:
        self._on_pause = on_pause
        self._min_pause_s = min_pause_s
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif now - self._start >= self._min_pause_s:
            self._on_pause(self._start, now)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
