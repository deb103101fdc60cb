"""The sole-prefill gate: dynamic sizing applies only while one request prefills alone.

How it moves: the scheduler reports, once per step, how many requests could prefill in that step
(running partial prefills + waiting requests that can prefill; aborted ones, those waiting for remote KV
and unschedulable ones do not count). The gate is open while none of the last 16 steps saw more than one.
Concurrent prefills already fill the pipeline bubbles, and smaller chunks would only add per-forward
and prefix-rebuild overhead; the 16-step memory keeps sizing from flapping as requests come and go.
"""

from __future__ import annotations

GATE_WINDOW_STEPS = 16


class SolePrefillGate:
    """Open while every one of the last `window` observed steps had at most one prefill source."""

    def __init__(self, window: int = GATE_WINDOW_STEPS) -> None:
        if window < 1:
            raise ValueError(f"gate window must be >= 1, got {window}")
        self._window = window
        # Only the distance to the last busy step matters; steps before the first observation count as
        # quiet (an idle engine has no other prefills). Capped at the window.
        self._quiet_steps = window

    def observe(self, num_prefill_sources: int) -> None:
        """Record one scheduler step (call before sizing that step's chunks)."""
        if num_prefill_sources < 0:
            raise ValueError(f"num_prefill_sources must be >= 0, got {num_prefill_sources}")
        self._quiet_steps = 0 if num_prefill_sources > 1 else min(self._quiet_steps + 1, self._window)

    @property
    def is_open(self) -> bool:
        return self._quiet_steps >= self._window

    @property
    def steps_until_open(self) -> int:
        """Quiet steps still needed before the gate opens (0 when open)."""
        return self._window - self._quiet_steps
