"""The steps in flight and the rule for how many: the engine's queue, also the simulator's (no jax).

A step is in flight from its submit to its collect, collected oldest first. How many may be in flight:

- `depth` = P, the pipeline's stages (+ 1 with async scheduling: the step scheduled while the oldest
  still runs). Decodes need no more: a sequence's next token needs its last one back first.
- Up to 2 · depth while no step in flight samples, i.e. all carry only middle prompt chunks. Those
  depend on nothing in flight (their K/V writes are ordered by each stage running steps in submission
  order), so a lone long prompt keeps the first stage busy even while the head waits for the last
  stage to acknowledge the oldest chunk (dynamic chunking's timings) or its hops are slow. The bound is
  activation memory: each such step holds at most one activation between two stages.

The planner's flow shop (`jaxcpp.chunking.makespan`) assumes the first stage never waits for a slot;
with 2 · depth slots that holds unless one chunk takes more than (2 · depth - 1) / (P - 1) times the
chunks after it, and the simulator (`jaxcpp.tools.simulator`) applies this same rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

Step = TypeVar("Step")

PREFILL_DEPTH_FACTOR = 2  # middle prompt chunks may go this many times deeper than steps that sample


class InFlight(Generic[Step]):
    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._steps: deque[tuple[Step, bool]] = deque()  # (step, samples), oldest first
        self._num_sampling = 0

    def has_room(self) -> bool:
        """Whether one more step may be submitted now (see the module docstring)."""
        n = len(self._steps)
        return n < self.depth or (n < PREFILL_DEPTH_FACTOR * self.depth and self._num_sampling == 0)

    def append(self, step: Step, samples: bool) -> None:
        """`samples`: the step samples a token (a decode, or a prompt's last chunk)."""
        self._steps.append((step, samples))
        self._num_sampling += samples

    @property
    def oldest(self) -> Step:
        return self._steps[0][0]

    def popleft(self) -> Step:
        step, samples = self._steps.popleft()
        self._num_sampling -= samples
        return step

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[Step]:
        return (step for step, _ in self._steps)
