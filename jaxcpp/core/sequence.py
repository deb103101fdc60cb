"""A request's life on the host: its tokens, how far its KV is computed, its pages (no jax).

A sequence's tokens are its prompt followed by its outputs. `num_computed_tokens` counts the tokens
whose K/V a scheduled step will have written; the scheduler advances it when it *schedules* a chunk,
so the next chunk of the same prompt can enter the pipeline before the previous one has left it.
A step whose chunk reaches the last token samples one new token; until that token is back the
sequence is `awaiting_token` (`num_pending` tokens sampled on the device, not yet on the host).
With async scheduling a decode may be scheduled while its input token is still pending: the step
takes it on the device from the output of the step that samples it (`pending_step`, row
`feedback_row`), so `num_computed_tokens` runs one ahead of the tokens the host knows.

With prefix caching a sequence is admitted with its cached prefix already computed: `pages[:n]` were
found in the cache or published to it (`num_published_pages`), `admission_prefix` is how many tokens
the cache gave it at its latest admission, `num_cached_tokens` at its first (what it reports).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jaxcpp.core.kv_transfer import KVOffer, KVTransferRequest
from jaxcpp.core.outputs import RequestMetrics, TokenLogprobs
from jaxcpp.core.prefix_cache import PageHash, PageHashes
from jaxcpp.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"        # a consumer's: its pages reserved, its prompt prefilled by a producer
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                   # the sampling seed actually used (params.seed or drawn)
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_pending: int = 0                        # tokens scheduled to be sampled, not yet collected
    pending_step: int = -1                      # the step that samples the newest pending token ...
    feedback_row: int = -1                      # ... and its row in that step's tokens
    finish_reason: str | None = None
    num_preemptions: int = 0
    logits: list[Any] = field(default_factory=list)  # per sampled token, only when the engine records them
    num_cached_tokens: int = 0                  # prompt tokens the prefix cache gave at first admission
    admission_prefix: int = 0                   # tokens the prefix cache gave at the latest admission
    num_published_pages: int = 0                # pages[:n] are in the prefix cache (found or published)
    history_slot: int = -1                      # its row of the device's penalty history, -1 = none
    num_history_tokens: int = 0                 # prompt tokens already in that row
    banned_ids: tuple[int, ...] = ()            # stop ids the device may not sample before min_tokens
    group: str | None = None                    # the request the n samples of one prompt came from
    logprobs: list[TokenLogprobs] = field(default_factory=list)         # per output token, when asked
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # per prompt token from the second
    kv_transfer: KVTransferRequest | None = None  # a producer's: offer the prompt's pages to a consumer
    kv_offer: KVOffer | None = None               # ... where they wait, once offered
    grammar: Any = None                         # a constrained request's RequestGrammar (jaxcpp.structured)
    _page_hashes: PageHashes | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Known tokens not yet scheduled for a forward pass (0 while a placeholder decode runs)."""
        return max(0, self.num_tokens - self.num_computed_tokens)

    @property
    def awaiting_token(self) -> bool:
        return self.num_pending > 0

    def expect_token(self, step_id: int, row: int) -> None:
        """A scheduled chunk of step `step_id` samples this sequence's next token, in row `row`."""
        self.num_pending += 1
        self.pending_step, self.feedback_row = step_id, row

    def receive_token(self, token: int) -> None:
        """The oldest pending token is back on the host."""
        self.output_token_ids.append(token)
        self.num_pending -= 1

    @property
    def is_decode(self) -> bool:
        return bool(self.output_token_ids) and self.num_remaining == 1

    @property
    def is_prefilling(self) -> bool:
        """Prompt tokens (or, after a preemption, earlier outputs) still to go through a forward."""
        return self.num_remaining > 0 and not self.is_decode

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without concatenating the two (decodes are hot)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def page_hashes(self, num_pages: int, page_size: int) -> list[PageHash]:
        """The chained hashes of the first `num_pages` full pages (computed once, then kept)."""
        if self._page_hashes is None:
            self._page_hashes = PageHashes(page_size, self.token_ids)
        return self._page_hashes.first(num_pages)

    def num_prompt_pages(self, page_size: int) -> int:
        """Pages its prompt's K/V fill (the last one partly): what moves in a KV transfer."""
        return -(-len(self.prompt_token_ids) // page_size)

    def pages_needed(self, num_new_tokens: int, page_size: int) -> int:
        """More pages this sequence needs before `num_new_tokens` more tokens can be written."""
        total = -(-(self.num_computed_tokens + num_new_tokens) // page_size)
        return max(0, total - len(self.pages))
