"""The scheduler's side of prefix caching: which cached pages a request may start from, which pages a
submitted step makes shareable, which samples of a group wait for a sibling's prefix, and the hit counts.

The rule (the scheduler's module docstring says why): a request reuses whole pages of its prompt, never
its last token, unless every prompt token must pass the device (penalties, prompt logprobs); a page is
registered once the step that fills it is submitted, so only later steps find it. The pages themselves,
their hashes' index and the LRU are `jaxcpp.core.page_allocator`'s.
"""

from __future__ import annotations

from jaxcpp.core.page_allocator import PageAllocator
from jaxcpp.core.prefix_cache import PageHash
from jaxcpp.core.scheduler_output import SchedulerOutput
from jaxcpp.core.sequence import Sequence, SequenceStatus

GroupPrefix = tuple[str, PageHash]  # (a group of samples, its prompt's first page)


class PrefixReuse:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.queried_tokens = 0  # prompt tokens of first admissions, looked up in the cache
        self.hit_tokens = 0      # of those, tokens the cache gave

    def cached_pages(self, seq: Sequence) -> list[int]:
        """Cached pages of the sequence's longest whole-page prefix, leaving its last token to compute.
        None for a request whose every prompt token must pass the device (penalties, prompt logprobs):
        as in vLLM, it computes its prompt (and still publishes its pages for others)."""
        if not self.enabled or seq.params.reads_history_on_device:
            return []
        return self.allocator.lookup(seq.page_hashes((seq.num_tokens - 1) // self.page_size, self.page_size))

    def count(self, seq: Sequence, hit_tokens: int) -> None:
        """A first admission's lookup, for the hit rate (which counts requests, not their recomputes)."""
        self.queried_tokens += len(seq.prompt_token_ids)
        self.hit_tokens += hit_tokens

    def group_prefix(self, seq: Sequence) -> GroupPrefix | None:
        """(its group, its prompt's first page) for a request of a group of samples the cache could serve."""
        if (seq.group is None or not self.enabled or len(seq.prompt_token_ids) <= self.page_size
                or seq.params.reads_history_on_device):
            return None
        return seq.group, seq.page_hashes(1, self.page_size)[0]

    def groups_in_progress(self, running: list[Sequence]) -> dict[GroupPrefix, Sequence]:
        """The running samples of a group whose prompt pages are not all published yet. The group's
        other samples wait for them rather than compute the same prefix in the same step: the n samples
        of one prompt share one prefill. (Unrelated requests with a common prefix admitted together
        still compute it twice.)"""
        found = {}
        for seq in running:
            shared = self.group_prefix(seq)
            if shared is not None and seq.num_published_pages < (len(seq.prompt_token_ids) - 1) // self.page_size:
                found[shared] = seq
        return found

    def publish_written(self, sched: SchedulerOutput) -> None:
        """Register the full pages a step fills, once it is submitted."""
        for chunk in sched.chunks:
            seq = chunk.seq
            # A page is hashed by its tokens: one holding a token still on the device waits a step.
            if seq.status is SequenceStatus.RUNNING:  # not aborted since
                self.publish(seq, min(chunk.start + chunk.num_tokens, seq.num_tokens) // self.page_size)

    def publish(self, seq: Sequence, full: int) -> None:
        """Register `seq`'s first `full` pages (those not yet registered) in the prefix cache."""
        if not self.enabled or full <= seq.num_published_pages:
            return  # no page filled up (most decodes)
        hashes = seq.page_hashes(full, self.page_size)
        for i in range(seq.num_published_pages, full):
            self.allocator.register(seq.pages[i], hashes[i])
        seq.num_published_pages = full

    def forget(self) -> None:
        """Drop the whole prefix cache: a failed step may have left pages it was to write unwritten."""
        self.allocator.clear_cache()  # surviving sequences' pages stay theirs, no longer shareable
