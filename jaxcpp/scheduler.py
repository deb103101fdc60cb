"""Continuous batching with Sarathi-style chunked prefill (host side, no jax).

Every step is built the same way:
  1. one token for each running decode (oldest first), preempting the newest sequences by recompute
     when pages run out;
  2. the rest of the token budget for prompt chunks: running partial prefills first, then waiting
     requests in arrival order, each taking min(remaining prompt, remaining budget).
A chunk advances its sequence's `num_computed_tokens` when it is scheduled; the chunk that reaches the
last token samples a token, and the sequence waits for it (`awaiting_token`) before its next step.
With chunked prefill off a prompt must fit the budget whole and goes in one forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from jaxcpp.config import SchedulerConfig
from jaxcpp.page_allocator import PageAllocator
from jaxcpp.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int           # first token position of the chunk (the cached prefix length)
    num_tokens: int
    samples: bool        # the chunk reaches the sequence's last token, so the step samples one


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class ChunkSizer(Protocol):
    """Decides how many prompt tokens a prefilling sequence takes this step (dynamic chunking)."""

    def prefill_chunk(self, seq: Sequence, budget: int) -> int: ...

    def observe_step(self, num_prefill_sources: int) -> None: ...


class FixedChunkSizer:
    """Sarathi's rule: as much of the prompt as the remaining budget holds."""

    def prefill_chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_remaining, budget)

    def observe_step(self, num_prefill_sources: int) -> None:
        pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 chunk_sizer: ChunkSizer | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.chunk_sizer = chunk_sizer or FixedChunkSizer()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in admission order: the oldest is preempted last
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and free its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.chunk_sizer.observe_step(self._num_prefill_sources())
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(out, budget)
        budget = self._schedule_prefills(out, budget, self._running_prefills())
        self._schedule_prefills(out, budget, list(self.waiting), admit=True)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if budget < 1 or len(out.chunks) >= self.config.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.awaiting_token or not seq.is_decode:
                continue
            if not self._make_room(seq, 1, out):
                continue  # seq itself was preempted
            self._take(out, seq, 1)
            out.num_decodes += 1
            budget -= 1
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, candidates: Iterable[Sequence],
                           admit: bool = False) -> int:
        for seq in candidates:
            if budget < 1 or len(out.chunks) >= self.config.max_num_seqs:
                break
            if not admit and seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            chunk = self._chunk_size(seq, budget)
            if chunk == 0:
                break
            if admit:
                need = seq.pages_needed(chunk, self.page_size)
                if not self.allocator.can_allocate(need):
                    break  # new prompts wait for pages rather than evict running work
                seq.pages += self.allocator.allocate(need)
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
            elif not self._make_room(seq, chunk, out):
                continue
            self._take(out, seq, chunk)
            budget -= chunk
        return budget

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        if not self.config.enable_chunked_prefill:
            return seq.num_remaining if seq.num_remaining <= budget else 0
        return min(self.chunk_sizer.prefill_chunk(seq, budget), seq.num_remaining, budget)

    def _take(self, out: SchedulerOutput, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_tokens
        samples = seq.num_computed_tokens == seq.num_tokens
        seq.awaiting_token = samples
        out.chunks.append(ScheduledChunk(seq, start, num_tokens, samples))

    def _running_prefills(self) -> list[Sequence]:
        return [s for s in self.running if s.is_prefilling and not s.awaiting_token]

    def _num_prefill_sources(self) -> int:
        """Requests that could take a prompt chunk now: partial prefills and waiting requests."""
        return sum(1 for s in self.running if s.is_prefilling) + len(self.waiting)

    # ---- preemption by recompute ---------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Free pages for `seq` by preempting the newest idle sequences; False if `seq` was the victim."""
        while not self.allocator.can_allocate(seq.pages_needed(num_tokens, self.page_size)):
            scheduled = {id(c.seq) for c in out.chunks}  # only when pages ran out: decodes are the hot path
            victim = next((s for s in reversed(self.running)
                           if id(s) not in scheduled and not s.awaiting_token), None)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        seq.pages += self.allocator.allocate(seq.pages_needed(num_tokens, self.page_size))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free_pages(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _free_pages(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
