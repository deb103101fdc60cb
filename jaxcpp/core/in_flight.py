"""The steps in flight and the rule for how many: the engine's queue, also the simulator's (no jax).

A step is in flight from its submit to its collect, collected oldest first. How many may be in flight:

- `depth` = P, the pipeline's stages (+ 1 with async scheduling: the step scheduled while the oldest
  still runs). Decodes need no more: a sequence's next token needs its last one back first, and a
  deeper pipe would only queue more prompt chunks ahead of every running stream's next token.
- Up to 2 · depth while no step in flight carries a decode, i.e. all carry prompt chunks. Those depend
  on nothing in flight (their K/V writes are ordered by each stage running steps in submission order;
  a prompt's last chunk samples, but only its own sequence's first decode waits for that token), so
  a long prompt keeps the first stage busy while the head waits for the last stage to acknowledge the
  oldest chunk (dynamic chunking's timings), while its hops are slow, and while another prompt's last
  chunk is still in the pipe (two concurrent prompts: the first one's sampling step no longer holds the
  second one's chunks back). The bound is activation memory: each such step holds at most one
  activation between two stages.

The planner's flow shop (`jaxcpp.chunking.makespan`) assumes the first stage never waits for a slot;
with 2 · depth slots that holds unless one chunk takes more than (2 · depth - 1) / (P - 1) times the
chunks after it, and the simulator (`jaxcpp.tools.simulator`) applies this same rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

Step = TypeVar("Step")

PREFILL_DEPTH_FACTOR = 2  # prompt chunks may go this many times deeper than steps with decodes


class InFlight(Generic[Step]):
    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._steps: deque[tuple[Step, bool]] = deque()  # (step, decodes), oldest first
        self._num_decoding = 0

    def has_room(self) -> bool:
        """Whether one more step may be submitted now (see the module docstring)."""
        n = len(self._steps)
        return n < self.depth or (n < PREFILL_DEPTH_FACTOR * self.depth and self._num_decoding == 0)

    def append(self, step: Step, decodes: bool) -> None:
        """`decodes`: the step carries a decode (a running sequence's next token)."""
        self._steps.append((step, decodes))
        self._num_decoding += decodes

    @property
    def oldest(self) -> Step:
        return self._steps[0][0]

    def popleft(self) -> Step:
        step, decodes = self._steps.popleft()
        self._num_decoding -= decodes
        return step

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[Step]:
        return (step for step, _ in self._steps)
