"""A constrained request's grammar inside the engine, and a step's bitmask (host side, no jax).

    seq.grammar = RequestGrammar(grammars.compile(constraint))  # compiling in the pool
    seq.grammar.ready        # the scheduler admits the request only once its own grammar is built
    bitmask = step_bitmask(sched, rows, words)   # None: no row of the step is constrained
    seq.grammar.accept(token)                     # postprocess advances it on the sampled token

The bitmask is [rows, words] int32 whatever the step (rows: the sampler's max_num_seqs, words: the
model's vocabulary / 32, rounded up), so neither a new grammar nor a new mix of constrained and free
rows changes a shape the device sees; free rows and padding rows are all ones (every token allowed). A
step without a constrained row has none: the last stage runs its sampler programs without a mask.

When may a row's mask be filled? Only once the request's previous token is on the host: the mask is
the grammar's state after that token. Two rules, by executor:
  - one that draws a step's tokens after its forward (`defers_masks`: the in-process pipeline): under
    async scheduling the constrained decode takes a fed-back placeholder like any other; its step is
    submitted with `defer_sampling`, and when the step it feeds back from has been collected (the
    grammar has the token), the engine fills the mask and calls `executor.sample(step_id, bitmask)`.
    The fill runs while the device runs the forward; nothing is submitted in between, so steps are
    sampled in order (the penalty history is donated state). vLLM splits its step the same way.
  - the others (stage processes): a constrained request never decodes from a placeholder
    (`Scheduler._can_decode_pending`), and the engine does not schedule ahead of a step that samples for
    one (`ConstrainedDecoding.holds_back`); the stream keeps one token per step, its batch loses the overlap.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxcpp.core.scheduler import SchedulerOutput
    from jaxcpp.structured.grammar import Matcher


class RequestGrammar:
    """One request's grammar: a compile in flight, then its own matcher."""

    def __init__(self, compiled: Future[Any], start: Any) -> None:
        """`start(compiled)`: the request's own matcher from the finished compile."""
        self._compiled = compiled
        self._start = start
        self._matcher: Matcher | None = None

    @property
    def ready(self) -> bool:
        """Built: the request may be scheduled (one whose compile failed never is: the engine fails it)."""
        return self._matcher is not None or (self._compiled.done() and self._compiled.exception() is None)

    @property
    def done(self) -> bool:
        """Built or failed."""
        return self._compiled.done()

    @property
    def matcher(self) -> Matcher:
        if self._matcher is None:
            self._matcher = self._start(self._compiled)  # raises the compile's error, if it failed
        return self._matcher

    def error(self) -> BaseException | None:
        """The compile's error, once it is done (None: built, or still compiling)."""
        return self._compiled.exception() if self._compiled.done() else None

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def step_bitmask(sched: SchedulerOutput, rows: int, words: int) -> np.ndarray | None:
    """The step's allowed tokens, row i for chunk i: its grammar's mask where the chunk samples for a
    constrained request, all ones elsewhere. None when the step has no constrained row."""
    constrained = [(i, c.seq.grammar) for i, c in enumerate(sched.chunks)
                   if c.samples and c.seq.grammar is not None and not c.seq.is_finished]  # a dropped placeholder
    if not constrained:
        return None
    bitmask = np.full((rows, words), -1, np.int32)
    for i, grammar in constrained:
        grammar.matcher.fill_bitmask(bitmask, i)
    return bitmask
