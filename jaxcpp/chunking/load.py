"""Whether prompts keep arriving while others prefill, from the scheduler's count of prefill sources.

The `optimal` planner scores a plan as its own makespan plus the stage-0 time it costs the prompts that
wait for it. Prompts that came together and nothing after (a batch) wait once: the queue behind a prompt
is all there is. Under sustained load (clients that send their next prompt after each answer, or any
stream that keeps the queue fed) the stage-0 time a plan adds delays every prompt served after it until
the queue runs dry, and a prompt that got its first token sooner only comes back sooner to wait. Looking
at the queue alone the two cannot be told apart when a burst comes in, so the sign is an arrival: a
prompt that comes while another is still prefilling means the load is sustained; one that comes to an
empty prefill queue ends it.

How it moves: the scheduler reports, once per step, how many requests could prefill (`observe`); the
controller reports each prompt whose last chunk it sized (`prefill_ended`). More sources than the
last step's still-prefilling ones are arrivals. (A last chunk sized but not scheduled, for want of pages,
reads as an arrival one step later: at worst one prompt is planned as one of a stream.)
"""

from __future__ import annotations

# Under sustained load, how many more times each prompt in circulation is expected to come back and wait
# for a plan's stage-0 time while the load lasts. Ours, chosen in the simulator's table
# (benchmarks/simulate_dynamic_chunking.py, closed loops of 4 clients): 0 trails the best fixed chunk in
# five of six rows, 1 only ties fixed 32K at 128K on PP 2, 3 gains 1 point less at 128K on PP 4, 4 trails
# at 128K on PP 2. Longer sustained loads would want more (its --sweep).
ROUNDS_AHEAD = 2


class PrefillLoad:
    """Tracks arrivals of prefills and the most prefill sources seen at once since the load began."""

    def __init__(self) -> None:
        self.sustained = False
        self.peak = 0            # most prefill sources seen in one step since the last arrival to an idle queue
        self._sources = 0        # the last observed step's
        self._ended = 0          # prompts whose last chunk was sized since the last observed step

    def prefill_ended(self) -> None:
        """A prompt's last chunk was sized: from the next step on it is no prefill source."""
        self._ended += 1

    def observe(self, num_prefill_sources: int) -> bool:
        """Record one scheduler step (before sizing its chunks); True when the load just became sustained."""
        still = max(self._sources - self._ended, 0)  # the last step's sources that are still prefilling
        became_sustained = False
        if num_prefill_sources > still:  # new prompts came
            became_sustained = still > 0 and not self.sustained
            self.sustained = still > 0
            if not self.sustained:
                self.peak = 0
        self.peak = max(self.peak, num_prefill_sources)
        self._sources, self._ended = num_prefill_sources, 0
        return became_sustained

    def waiting_for(self, queued: int) -> int:
        """How many prompts wait for the stage-0 time of a plan with `queued` prompts behind it: those,
        and under sustained load each prompt in circulation (`peak`) `ROUNDS_AHEAD` more times."""
        return queued + ROUNDS_AHEAD * self.peak if self.sustained else queued
