"""The sole-prefill gate: dynamic sizing applies only while one request prefills alone.

How it moves: the scheduler reports, once per step, how many requests could prefill in that step
(running partial prefills + waiting requests that can prefill; aborted ones, those waiting for remote KV
and unschedulable ones do not count). The gate is open while none of the last 16 steps saw more than one.
Concurrent prefills already fill the pipeline bubbles, and smaller chunks would only add per-forward
and prefix-rebuild overhead; the 16-step memory keeps sizing from flapping as requests come and go.
"""

from __future__ import annotations

from collections import deque

GATE_WINDOW_STEPS = 16


class SolePrefillGate:
    """Open while every one of the last `window` observed steps had at most one prefill source."""

    def __init__(self, window: int = GATE_WINDOW_STEPS) -> None:
        if window < 1:
            raise ValueError(f"gate window must be >= 1, got {window}")
        self._recent: deque[int] = deque(maxlen=window)

    def observe(self, num_prefill_sources: int) -> None:
        """Record one scheduler step (call before sizing that step's chunks)."""
        if num_prefill_sources < 0:
            raise ValueError(f"num_prefill_sources must be >= 0, got {num_prefill_sources}")
        self._recent.append(num_prefill_sources)

    @property
    def is_open(self) -> bool:
        # Steps before the first observation count as quiet: an idle engine has no other prefills.
        return all(n <= 1 for n in self._recent)

    @property
    def steps_until_open(self) -> int:
        """Quiet steps still needed before the gate opens (0 when open)."""
        busy = [i for i, n in enumerate(self._recent) if n > 1]
        return 0 if not busy else busy[-1] + 1 + (self._recent.maxlen or 0) - len(self._recent)
