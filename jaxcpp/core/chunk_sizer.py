"""How many prompt tokens a prefilling sequence takes this step: the scheduler's one seam with dynamic
chunking (`ChunkSizer`, met by `jaxcpp.chunking.controller.DynamicChunkController` and the simulator's
policies), and Sarathi's fixed rule (`FixedChunkSizer`), the default."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol


class ChunkRequest(Protocol):
    """What a chunk sizer reads of a request (a `Sequence`, or the simulator's stand-in)."""

    @property
    def request_id(self) -> Hashable: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_remaining(self) -> int: ...


class ChunkSizer(Protocol):
    """Dynamic chunking's one seam with the scheduler, and all the scheduler asks of it: how many prompt
    tokens a prefilling sequence takes this step, and what it learns from the steps that ran
    (`jaxcpp.chunking.controller.DynamicChunkController`; its start-up sweep and its stats are the
    engine's business with the controller, not the scheduler's)."""

    @property
    def needs_ack(self) -> bool: ...

    def observe_step(self, num_prefill_sources: int) -> None: ...

    def prefill_chunk(self, seq: ChunkRequest, budget_left: int, step_tokens: int) -> int: ...

    def record_timing(self, num_tokens: int, prefix: int, seconds: float, batch_is_sole_prefill: bool,
                      request_id: Hashable) -> None: ...

    def finish_request(self, request_id: Hashable) -> None: ...


class FixedChunkSizer:
    """Sarathi's rule: as much of the prompt as the budget left holds. Learns nothing."""

    needs_ack = False

    def observe_step(self, num_prefill_sources: int) -> None:
        pass

    def prefill_chunk(self, seq: ChunkRequest, budget_left: int, step_tokens: int) -> int:
        return min(seq.num_remaining, budget_left)

    def record_timing(self, num_tokens: int, prefix: int, seconds: float, batch_is_sole_prefill: bool,
                      request_id: Hashable) -> None:
        pass

    def finish_request(self, request_id: Hashable) -> None:
        pass
