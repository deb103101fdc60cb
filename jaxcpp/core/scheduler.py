"""Continuous batching with Sarathi-style chunked prefill, and the one owner of request state (no jax).

Every step is built the same way:
  1. one token for each running decode (oldest first), preempting the newest sequences by recompute
     when pages run out;
  2. what is left of the token budget for prompt chunks: running partial prefills first, then waiting
     requests in arrival order, each taking min(remaining prompt, budget left).
A chunk advances its sequence's `num_computed_tokens` when it is scheduled; the chunk that reaches the
last token samples a token, and the sequence waits for it (`awaiting_token`) before its next step.
With chunked prefill off a prompt must fit the budget whole and goes in one forward.

Async scheduling: `schedule(feedback_from=k)` while step k is still on the device. A sequence whose
only pending token is sampled by step k decodes anyway, with a placeholder: its chunk names the row of
step k's tokens the first stage reads its input from (`feedback_row`), so the host never waits for a
token it only passes back. Not when that token must be its last (max_tokens, max-model-len); if it
turns out to be a stop, the extra token is dropped when it arrives and its pages are already free.

Prefix caching (`jaxcpp.core.prefix_reuse`, over `jaxcpp.core.page_allocator`): a request is admitted with the longest
prefix of whole pages the cache holds already computed, never its last token (whose logits sample the
next one), so at most (num_tokens - 1) // page_size pages; chunks and the token budget count only the
rest. A preempted request is admitted the same way and finds its own pages if they were not evicted.
When may a page be shared? Its K/V is written when the step that computes its last token runs on every
stage, later than it is scheduled. Each stage runs steps in submission order (its KV pages are donated
from one step to the next), so a step submitted after the writing step reads the written page on every
stage. Hence `publish_written_pages(sched)`, called once the step is submitted, registers the pages
that step fills, and only later steps can look them up: two requests admitted in the same step compute
their common prefix twice, and the second copy stays private. A request aborted mid-prefill leaves the
pages of its submitted chunks cached and frees the rest. After a failed step nothing cached can be
trusted: `forget_cached_pages()`.

`postprocess(sched, result)` is the only place a collected step changes sequences: it appends the
sampled tokens, stamps the metrics, finishes what hit a stop or its length (freeing the pages), and
forwards the step's timing and the finished requests to the chunk sizer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from jaxcpp.config import SchedulerConfig
from jaxcpp.core.chunk_sizer import ChunkSizer, FixedChunkSizer
from jaxcpp.core.outputs import TokenLogprobs
from jaxcpp.core.page_allocator import PageAllocator
from jaxcpp.core.prefix_reuse import GroupPrefix, PrefixReuse
from jaxcpp.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxcpp.core.sequence import Sequence, SequenceStatus
from jaxcpp.core.step_result import Logprobs, StepResult
from jaxcpp.core.stopping import StopRule

__all__ = ["ChunkSizer", "FixedChunkSizer", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StopRule"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 chunk_sizer: ChunkSizer | None = None, stop: StopRule | None = None,
                 prefix_caching: bool = False) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.chunk_sizer: ChunkSizer = chunk_sizer or FixedChunkSizer()
        self.stop = stop or StopRule()
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in admission order: the oldest is preempted last
        self.remote: list[Sequence] = []      # a consumer's, prefilled by a producer (pages reserved or not yet)
        self.num_preemptions = 0
        self.num_steps = 0
        self.prefix = PrefixReuse(allocator, page_size, prefix_caching)
        self.free_history_slots = list(range(config.max_num_seqs))[::-1]  # device penalty-history rows
        self.constrained_placeholders = False  # the engine fills a constrained placeholder's mask late

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def add_remote(self, seq: Sequence) -> None:
        """A consumer's request: a producer prefills it (`reserve_remote`, then `admit_remote`)."""
        self.requests[seq.request_id] = seq
        seq.status = SequenceStatus.REMOTE
        self.remote.append(seq)

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """Retire a sequence (finished, aborted or failed) and free its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.REMOTE:
            self.remote.remove(seq)
        self._free_pages(seq)
        if seq.history_slot >= 0:
            self.free_history_slots.append(seq.history_slot)
            seq.history_slot = -1
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now
        self.requests.pop(seq.request_id, None)
        self.chunk_sizer.finish_request(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self, feedback_from: int | None = None) -> SchedulerOutput:
        """The next step; `feedback_from`: a step still in flight whose tokens this one may take."""
        out = SchedulerOutput(step_id=self.num_steps, feedback_from=feedback_from)
        self.chunk_sizer.observe_step(self._num_prefill_sources())
        budget_left = self.config.max_num_batched_tokens
        budget_left = self._schedule_decodes(out, budget_left)
        budget_left = self._schedule_prefills(out, budget_left, self._running_prefills())
        self._schedule_prefills(out, budget_left, list(self.waiting), admit=True)
        out.ack = self.chunk_sizer.needs_ack
        self.num_steps += not out.is_empty  # ids count the steps that run: consecutive from 0
        return out

    def postprocess(self, sched: SchedulerOutput, result: StepResult, now: float) -> list[Sequence]:
        """Apply a collected step; returns the sequences that got a token (finished ones included)."""
        self._record_timing(sched, result)
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(sched, result.prompt_logprobs)
        sampled = []
        for i, chunk in enumerate(sched.chunks):
            seq = chunk.seq
            if not chunk.samples or seq.is_finished:
                continue  # a middle prefill chunk, or a request aborted while its step was in flight
            assert result.tokens is not None, "a step that samples was submitted without want_tokens"
            token = int(result.tokens[i])
            seq.receive_token(token)
            if seq.grammar is not None and not seq.grammar.accept(token):
                self.finish(seq, "error", now)  # the mask allowed it: the sampler ignored the mask
                sampled.append(seq)
                continue
            seq.metrics.record_token(now)
            if result.logits is not None:
                seq.logits.append(result.logits[i])
            if result.logprobs is not None and seq.params.logprobs is not None:
                seq.logprobs.append(_token_logprobs(result.logprobs, i, token, seq.params.logprobs))
            reason = self.stop.finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
            sampled.append(seq)
        return sampled

    @staticmethod
    def _record_prompt_logprobs(sched: SchedulerOutput, scored: Logprobs) -> None:
        """Each chunk's prompt tokens' log-probabilities, in order, once (a recompute scores them again)."""
        row = 0
        for chunk in sched.chunks:
            seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
            if k is not None:
                prompt = seq.prompt_token_ids
                for p in range(max(chunk.start, len(seq.prompt_logprobs)),
                               min(chunk.start + chunk.num_tokens, len(prompt) - 1)):
                    seq.prompt_logprobs.append(_token_logprobs(scored, row + p - chunk.start, prompt[p + 1], k))
            row += chunk.num_tokens

    def _record_timing(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Feed the calibration: a batch that is one prefill chunk alone, timed on the device, paired with
        the token count that actually ran (the padded bucket), not the chunk's own length."""
        seconds = result.forward_time
        if seconds is None or len(sched.chunks) != 1:
            return
        chunk = sched.chunks[0]
        if chunk.start >= len(chunk.seq.prompt_token_ids):
            return  # a decode
        self.chunk_sizer.record_timing(result.timings[0].num_tokens_padded, chunk.start, seconds, True,
                                       chunk.seq.request_id)

    def _schedule_decodes(self, out: SchedulerOutput, budget_left: int) -> int:
        for seq in list(self.running):
            if budget_left < 1 or len(out.chunks) >= self.config.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            placeholder = self._can_decode_pending(seq, out.feedback_from)
            if not placeholder and (seq.awaiting_token or not seq.is_decode):
                continue
            if not self._make_room(seq, 1, out):
                continue  # seq itself was preempted
            self._take(out, seq, 1, feedback_row=seq.feedback_row if placeholder else -1)
            out.num_decodes += 1
            budget_left -= 1
        return budget_left

    def waits_for_constrained_token(self, step_id: int) -> bool:
        """A running constrained request's next token is sampled by step `step_id`: scheduling ahead of
        that step would leave it out (its mask needs that token on the host), so the engine collects first."""
        return any(s.grammar is not None and s.num_pending == 1 and s.pending_step == step_id for s in self.running)

    def _can_decode_pending(self, seq: Sequence, feedback_from: int | None) -> bool:
        """Its one pending token comes from the fed-back step, is the next to compute, and may not be
        its last (a placeholder decode past max_tokens or the model's length would only be dropped)."""
        if feedback_from is None or seq.num_pending != 1 or seq.pending_step != feedback_from:
            return False
        if seq.grammar is not None and not self.constrained_placeholders:
            return False  # its next mask is its grammar's state after that token (jaxcpp.structured.request)
        return seq.num_computed_tokens == seq.num_tokens and not self.stop.at_length(seq, ahead=1)

    def _schedule_prefills(self, out: SchedulerOutput, budget_left: int, candidates: Iterable[Sequence],
                           admit: bool = False) -> int:
        in_progress: dict[GroupPrefix, Sequence] | None = None  # built when a sample of a group waits
        for seq in candidates:
            if budget_left < 1 or len(out.chunks) >= self.config.max_num_seqs:
                break
            if not admit and seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if admit:
                if seq.awaiting_token:
                    break  # preempted with a token in flight: its recompute needs that token
                if seq.grammar is not None and not seq.grammar.ready:
                    continue  # its grammar compiles in the pool: the others go ahead
                shared = self.prefix.group_prefix(seq)
                if shared is not None:
                    in_progress = self.prefix.groups_in_progress(self.running) if in_progress is None else in_progress
                    if shared in in_progress:
                        continue  # a sibling is computing its prefix: wait and read it from the cache
                chunk = self._admit(seq, budget_left, out.num_tokens)
                if chunk and shared is not None and in_progress is not None:
                    in_progress[shared] = seq
                if chunk == 0:
                    break  # new prompts wait for pages rather than evict running work
            else:
                chunk = self._chunk_size(seq, budget_left, out.num_tokens)
                if chunk == 0:
                    break
                if not self._make_room(seq, chunk, out):
                    continue
            self._take(out, seq, chunk)
            budget_left -= chunk
        return budget_left

    def _admit(self, seq: Sequence, budget_left: int, step_tokens: int) -> int:
        """Start a waiting sequence from its cached prefix with the pages of its first chunk; returns the
        chunk, or 0 with nothing changed when no chunk fits the budget or its pages (or, for a request
        with penalties, a row of the device's history) are not there."""
        if seq.params.has_penalties and seq.history_slot < 0 and not self.free_history_slots:
            return 0
        hits = self.prefix.cached_pages(seq)
        seq.num_computed_tokens = len(hits) * self.page_size  # the chunk sizer plans from here
        chunk = self._chunk_size(seq, budget_left, step_tokens)
        need = -(-(seq.num_computed_tokens + chunk) // self.page_size) - len(hits)
        if chunk == 0 or not self.allocator.can_allocate(need, reusing=hits):
            seq.num_computed_tokens = 0
            return 0
        self.allocator.acquire(hits)
        seq.pages = hits + self.allocator.allocate(need)
        if seq.params.has_penalties and seq.history_slot < 0:
            seq.history_slot = self.free_history_slots.pop()
        seq.num_published_pages = len(hits)
        seq.admission_prefix = seq.num_computed_tokens
        if seq.num_preemptions == 0:  # the hit rate counts requests, not their recomputes
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix.count(seq, seq.num_computed_tokens)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        return chunk

    # ---- a consumer's requests (disaggregation) ------------------------------------------------
    def reserve_remote(self, seq: Sequence) -> int | None:
        """Pages for a remote request's whole prompt, its cached prefix first; the number of cached pages
        (the producer offers the rest), or None with nothing changed when the pages are not there."""
        hits = self.prefix.cached_pages(seq)
        need = seq.num_prompt_pages(self.page_size) - len(hits)
        if not self.allocator.can_allocate(need, reusing=hits):
            return None
        self.allocator.acquire(hits)
        seq.pages = hits + self.allocator.allocate(need)
        seq.num_published_pages = len(hits)
        seq.num_cached_tokens = seq.admission_prefix = len(hits) * self.page_size
        self.prefix.count(seq, seq.num_cached_tokens)
        return len(hits)

    def admit_remote(self, seq: Sequence, first_token: int, now: float) -> None:
        """Its prompt's K/V are in its pages (written by a step-ordered import) and its first token is
        back: it runs on as a decode, or finishes at once."""
        self.remote.remove(seq)
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.prefix.publish(seq, len(seq.prompt_token_ids) // self.page_size)
        seq.num_pending += 1
        seq.receive_token(first_token)
        seq.metrics.record_token(now)
        reason = self.stop.finish_reason(seq, first_token)
        if reason is not None:
            self.finish(seq, reason, now)

    # ---- after scheduling --------------------------------------------------------------------
    def drop_chunks(self, sched: SchedulerOutput, indices: set[int]) -> None:
        """Take chunks out of a step not yet submitted (their requests failed and are finished): the rest
        move up, and a sampling chunk's sequence learns its new row (what a later step feeds back from)."""
        sched.num_decodes -= sum(i < sched.num_decodes for i in indices)
        sched.chunks = [c for i, c in enumerate(sched.chunks) if i not in indices]
        for row, chunk in enumerate(sched.chunks):
            if chunk.samples and chunk.seq.pending_step == sched.step_id:
                chunk.seq.feedback_row = row

    # ---- the prefix cache (jaxcpp.core.prefix_reuse) -------------------------------------------
    def publish_written_pages(self, sched: SchedulerOutput) -> None:
        """Register the full pages a step fills, once it is submitted (see the module docstring)."""
        self.prefix.publish_written(sched)

    def forget_cached_pages(self) -> None:
        """Drop the whole prefix cache: a failed step may have left pages it was to write unwritten."""
        self.prefix.forget()

    @property
    def prefix_queried_tokens(self) -> int:
        return self.prefix.queried_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.prefix.hit_tokens

    # ---- helpers -------------------------------------------------------------------------------
    def _chunk_size(self, seq: Sequence, budget_left: int, step_tokens: int) -> int:
        if not self.config.enable_chunked_prefill:
            return seq.num_remaining if seq.num_remaining <= budget_left else 0
        return min(self.chunk_sizer.prefill_chunk(seq, budget_left, step_tokens), seq.num_remaining, budget_left)

    def _take(self, out: SchedulerOutput, seq: Sequence, num_tokens: int, feedback_row: int = -1) -> None:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_tokens
        samples = feedback_row >= 0 or seq.num_computed_tokens == seq.num_tokens
        if samples:
            seq.expect_token(out.step_id, len(out.chunks))
        out.chunks.append(ScheduledChunk(seq, start, num_tokens, samples, feedback_row,
                                         self._history_start(seq, start)))

    @staticmethod
    def _history_start(seq: Sequence, start: int) -> int:
        """Where the chunk's prompt tokens start joining the device history (-1: none do). A recompute
        after a preemption adds nothing: the history row was kept, and it already counts the outputs."""
        end = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
        if seq.history_slot < 0 or end <= seq.num_history_tokens:
            return -1
        first, seq.num_history_tokens = seq.num_history_tokens, end
        assert first >= start, "a request with a device history starts from position 0 (no cached prefix)"
        return first

    def _running_prefills(self) -> list[Sequence]:
        return [s for s in self.running if s.is_prefilling and not s.awaiting_token]

    def _num_prefill_sources(self) -> int:
        """Requests that could take a prompt chunk now: partial prefills and waiting requests."""
        return sum(1 for s in self.running if s.is_prefilling) + len(self.waiting)

    # ---- preemption by recompute ---------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Free pages for `seq` by preempting the newest sequences not in this step; False if `seq` was
        the victim. A victim may still have a token in flight (async scheduling): the steps in flight
        finish with its pages before any later step's new owner writes them, the token is kept when it
        arrives, and the victim is re-admitted only after that (`_schedule_prefills`)."""
        while not self.allocator.can_allocate(seq.pages_needed(num_tokens, self.page_size)):
            scheduled = {id(c.seq) for c in out.chunks}  # only when pages ran out: decodes are the hot path
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        seq.pages += self.allocator.allocate(seq.pages_needed(num_tokens, self.page_size))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free_pages(seq)  # published pages stay cached: re-admission finds them unless evicted
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _free_pages(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_published_pages = 0


def _token_logprobs(scored: Logprobs, row: int, token: int, k: int) -> TokenLogprobs:
    top = tuple(zip(scored.top_ids[row, :k].tolist(), scored.top_logprobs[row, :k].tolist(), strict=True))
    return TokenLogprobs(token, float(scored.logprobs[row]), top)
