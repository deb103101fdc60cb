"""Structured outputs' engine side, one seam: grammars compiling, each step's masks, the late draw. No jax.

    engine.add_request     constrained.add(seq)               its grammar compiles in the pool (or is found
                                                              cached); the scheduler admits it once built
    engine.step()          constrained.failed_grammars()      requests whose grammar failed: error outputs
    engine._submit_next    constrained.holds_back(oldest)     collect (or draw) before anything is submitted
                           constrained.masks(sched, phase)    the step's bitmask, or "its draw comes later"
                           constrained.submitted(sched, ...)
    engine._collect_oldest constrained.draw_late(step, phase) the step waiting for this one's tokens: its
                                                              masks filled, its draw dispatched

A constrained request waits in the scheduler until its own grammar is built in the pool; each step
carries the grammar masks of its constrained rows, filled on the host after the step is built. A
decode whose previous token is still on the device cannot have its mask yet: with an executor that
`defers_masks` (the in-process pipeline) under async scheduling it is scheduled ahead anyway, its step
submitted without its draw, and the mask filled and the draw dispatched once the step before it is
collected, while the device runs the forward (vLLM splits execute_model and sample_tokens the same
way). Other executors never schedule such a decode ahead (`holds_back`). The rules and why:
`jaxcpp.structured.request`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import numpy as np

from jaxcpp.core.executor import Executor, ExecutorError
from jaxcpp.core.outputs import RequestOutput
from jaxcpp.core.scheduler import Scheduler, SchedulerOutput
from jaxcpp.core.sequence import Sequence
from jaxcpp.core.sizing import EngineSizing
from jaxcpp.errors import InvalidRequestError
from jaxcpp.structured.request import RequestGrammar, step_bitmask
from jaxcpp.tokenizer import Tokenizer

if TYPE_CHECKING:  # built on first use: the library loads only when a request needs it
    from jaxcpp.structured.grammar import GrammarCompiler

Output = Callable[[Sequence, list[int]], RequestOutput]  # the engine's output of a request
Phase = Callable[[str], AbstractContextManager[None]]    # the engine's host-phase timer (`PhaseRecorder`)


class ConstrainedDecoding:
    """The engine's constrained requests: their grammars, and the one step that may await its draw."""

    def __init__(self, scheduler: Scheduler, executor: Executor, sizing: EngineSizing, async_scheduling: bool,
                 output: Output, on_failed_draw: Callable[[int], None]) -> None:
        """`on_failed_draw(step_id)`: a late draw failed, so the executor holds nothing more of that step."""
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer: Tokenizer | None = sizing.spec.tokenizer
        self.vocab_size = sizing.spec.config.vocab_size  # the logits' width (the tokenizer's may be less)
        self.rows = sizing.shape.max_num_seqs            # the sampler's rows
        self._output = output
        self._on_failed_draw = on_failed_draw
        self.grammars: GrammarCompiler | None = None  # built with the first constrained request
        self.compiling: list[Sequence] = []  # requests whose grammar is still compiling
        # async scheduling + an executor that can draw a step's tokens after its forward: a constrained
        # decode takes a placeholder, and its mask is filled once the token before it is collected
        self.defers = async_scheduling and getattr(executor, "defers_masks", False)
        scheduler.constrained_placeholders = self.defers
        self.awaiting: SchedulerOutput | None = None  # the step submitted without its draw

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Start `seq`'s grammar compiling in the pool (or find it cached): the request waits in the
        scheduler until its own grammar is built, never holding up the loop."""
        constraint = seq.params.structured_outputs
        assert constraint is not None
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs", "this model folder has no tokenizer: a grammar "
                                      "is over the tokenizer's tokens")
        if self.grammars is None:
            from jaxcpp.structured.grammar import GrammarCompiler

            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        seq.grammar = RequestGrammar(self.grammars.compile(constraint), self.grammars.matcher)
        self.compiling.append(seq)

    def failed_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to build end with an error naming the field (no page was taken:
        they never left the waiting queue)."""
        failed: list[RequestOutput] = []
        for seq in [s for s in self.compiling if s.grammar.done]:
            self.compiling.remove(seq)
            error = seq.grammar.error()
            if error is not None and not seq.is_finished:
                self.scheduler.finish(seq, "error", time.monotonic())
                failed.append(dataclasses.replace(self._output(seq, []), error=str(error)))
        return failed

    # ---- steps ---------------------------------------------------------------------------------
    def holds_back(self, oldest: int | None) -> bool:
        """Nothing is submitted now: the step awaiting its draw comes first (steps are sampled in order),
        or, with an executor that cannot draw late, the oldest step in flight (`oldest`, async scheduling)
        samples a constrained request's next token, which the next mask needs on the host."""
        if self.awaiting is not None:
            return True
        return (oldest is not None and self.grammars is not None and not self.defers
                and self.scheduler.waits_for_constrained_token(oldest))

    def masks(self, sched: SchedulerOutput, phase: Phase) -> tuple[np.ndarray | None, bool]:
        """(the step's bitmask, whether its draw waits): no mask without a constrained row; none yet
        when a constrained row's previous token is still on the device (a placeholder: `draw_late`)."""
        if self.grammars is None:  # no constrained request came yet
            return None, False
        if any(c.feedback_row >= 0 and c.seq.grammar is not None for c in sched.chunks):
            return None, True
        with phase("mask"):
            return step_bitmask(sched, self.rows, self.grammars.words), False

    def submitted(self, sched: SchedulerOutput, deferred: bool) -> None:
        self.awaiting = sched if deferred else None

    def draw_late(self, collected: int, phase: Phase) -> None:
        """Step `collected` was just postprocessed: if the step awaiting its draw feeds back from it, its
        constrained rows' grammars have their previous token now, so its masks are filled and its tokens
        drawn (`executor.sample`), while the device runs its forward. Raises the executor's errors."""
        pending = self.awaiting
        if pending is None or pending.feedback_from != collected:
            return
        assert self.grammars is not None
        self.awaiting = None
        with phase("mask"):
            bitmask = step_bitmask(pending, self.rows, self.grammars.words)
        try:
            self.executor.sample(pending.step_id, bitmask)  # type: ignore[attr-defined]
        except ExecutorError:
            self._on_failed_draw(pending.step_id)
            raise
