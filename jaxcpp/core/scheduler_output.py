"""What the scheduler decided for one step: plain data, read by step_input, the engine and its helpers.

    ScheduledChunk   one sequence's tokens in the step: where they start, how many, whether the step
                     samples its next token, where a fed-back decode reads its input token
    SchedulerOutput  the step: its chunks (decodes first), what was preempted to make room, whether the
                     chunk sizer waits for its timing, the step it feeds back from
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxcpp.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int           # first token position of the chunk (the cached prefix length)
    num_tokens: int
    samples: bool        # the chunk reaches the sequence's last token, so the step samples one
    feedback_row: int = -1  # >= 0: a decode whose input token is still on the device, sampled in
                            # this row of the step it feeds back from (`SchedulerOutput.feedback_from`)
    history_start: int = -1  # >= 0: the chunk's prompt tokens from this position on join the request's
                             # device history (penalties); 0 also empties its slot first


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    ack: bool = False    # the chunk sizer needs this step's timing: the head waits for the last stage
    step_id: int = 0     # the scheduler's count of steps
    feedback_from: int | None = None  # the step whose tokens this one's placeholder decodes take

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def feeds_back(self) -> bool:
        return any(c.feedback_row >= 0 for c in self.chunks)

    @property
    def samples(self) -> bool:
        """Some chunk reaches its sequence's end, so the step's tokens are needed."""
        return any(c.samples for c in self.chunks)

    @property
    def wants_logprobs(self) -> bool:
        return any(c.samples and c.seq.params.logprobs is not None for c in self.chunks)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some chunk scores prompt tokens (all but the last prompt token have a next one to score)."""
        return any(c.seq.params.prompt_logprobs is not None and c.start < len(c.seq.prompt_token_ids) - 1
                   for c in self.chunks)

    @property
    def fits_rungs(self) -> bool:
        """It may take a rung below the token buckets (`jaxcpp.core.buckets`): it scores no prompt token."""
        decode_only = self.num_decodes == len(self.chunks)  # decodes score none: no scan of 64 chunks a step
        return bool(self.chunks) and (decode_only or not self.wants_prompt_logprobs)
