"""What an executor hands back for a step (`jaxcpp.core.executor`'s contract): plain numpy data.

Its own module so that the scheduler, which reads results, does not import the executor contract, which
takes step inputs built from the scheduler's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageTiming:
    """When one stage ran one step (perf_counter seconds, or a fake executor's clock)."""

    step_id: int
    stage: int
    num_tokens_padded: int  # the padded token count that ran (the bucket)
    traced: bool          # False for warm-up batches
    dispatched: float
    inputs_ready: float
    start: float          # max(inputs ready, dispatched, previous completion on the stage)
    done: float

    @property
    def forward(self) -> float:
        return self.done - self.start


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities the device computed, one row per sequence (sampled) or per token (prompt)."""

    logprobs: np.ndarray      # [N] float32: of the token chosen (sampled, or the next prompt token)
    top_ids: np.ndarray       # [N, MAX_LOGPROBS] int32, most likely first
    top_logprobs: np.ndarray  # [N, MAX_LOGPROBS] float32


@dataclass(frozen=True)
class StepResult:
    tokens: np.ndarray | None             # [S] int32 (padding rows: garbage); None if want_tokens=False
    logits: np.ndarray | None = None      # [S, V] float32, when submitted with want_logits=True
    timings: tuple[StageTiming, ...] = ()  # one per stage in stage order, when submitted with ack=True
    logprobs: Logprobs | None = None      # [S] rows, when submitted with want_logprobs=True
    prompt_logprobs: Logprobs | None = None  # [T] rows, when submitted with want_prompt_logprobs=True

    @property
    def forward_time(self) -> float | None:
        """The slowest stage's model-call time (what the latency model describes), when timed."""
        return max(t.forward for t in self.timings) if self.timings else None
