"""The edge between the engine and its front ends (offline `LLM`, gRPC, OpenAI HTTP): host only, no jax.

The engine deals in token ids; what clients see is made here, off the engine thread (on the servers'
asyncio loop; in `LLM`, between steps):

    fan_out(request_id, params)   n samples of a prompt -> n engine requests (seeds seed + i, one group,
                                  so the scheduler lets them share one prefill)
    SampleStream.process(out)     engine output -> SampleDelta: the text delta (incremental
                                  detokenizer), the token ids and logprobs of this delta, and the finish:
                                  a stop string ends the sample here (its text cut before the string
                                  unless include_stop_str_in_output); the caller then aborts the engine
                                  request, and anything the engine still sends is ignored
    RequestState.take(out, abort) the output loop's step, written once for LLM, gRPC and HTTP: the
                                  delta, and the abort of a sample a stop string ended

Streaming holds back the last len(longest stop string) - 1 characters of text until it is known that
they do not begin a stop string (as vLLM does), so no client ever sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxcpp.core.outputs import RequestOutput, TokenLogprobs
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.tokenizer import IncrementalDetokenizer, Tokenizer


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """One engine request per sample: the id itself when n = 1, else `{id}#{i}` with seed + i."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}#{i}", params.sample(i)) for i in range(params.n)]


@dataclass
class SampleDelta:
    """What one engine output adds to one sample, as a client should see it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None        # of these token_ids, when asked
    finished: bool = False
    finish_reason: str | None = None            # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None        # the stop string or stop token id that ended it


@dataclass
class SampleStream:
    """One sample's (one engine request's) text and stop strings."""

    index: int
    params: SamplingParams
    tokenizer: Tokenizer | None
    text: str = ""                               # all text so far, stop string cut
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    streaming: bool = True                       # text deltas wanted as tokens arrive (the servers)
    _sent: int = 0                               # characters of `text` handed out so far
    _detok: IncrementalDetokenizer | None = None

    @property
    def _reach(self) -> int:
        """Characters of old text a stop string completed by new text may begin in."""
        return max(map(len, self.params.stop), default=1) - 1

    @property
    def _holdback(self) -> int:
        return 0 if self.params.include_stop_str_in_output else self._reach

    def process(self, out: RequestOutput) -> SampleDelta | None:
        """The delta `out` brings, or None once this sample has finished (late engine outputs)."""
        if self.finished:
            return None
        new_ids = list(out.new_token_ids)
        self.token_ids += new_ids
        new_logprobs = list(out.logprobs) if out.logprobs is not None else None  # of new_ids
        if new_logprobs is not None:
            self.logprobs += new_logprobs
        self._add_text(out, new_ids)
        if out.finished:
            self.finished, self.finish_reason = True, out.finish_reason
            if out.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in self.params.stop_token_ids:
                self.stop_reason = out.token_ids[-1]
        return SampleDelta(self.index, self._take_text(), new_ids, new_logprobs, self.finished,
                           self.finish_reason, self.stop_reason)

    def _add_text(self, out: RequestOutput, new_ids: list[int]) -> None:
        if self.tokenizer is None:
            return
        if not self.streaming and not self.params.stop:  # nothing to watch for: decode once, at the end
            self.text = self.tokenizer.decode(self.token_ids) if out.finished else ""
            return
        if self._detok is None:  # the prompt's last ids give the first tokens their context
            self._detok = IncrementalDetokenizer(self.tokenizer, out.prompt_token_ids)
        start = max(0, len(self.text) - self._reach)
        self.text += self._detok.step(new_ids) + (self._detok.flush() if out.finished else "")
        if self.params.stop and len(self.token_ids) >= self.params.min_tokens:
            self._match_stop(start)

    def _match_stop(self, start: int) -> None:
        found = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return
        i, stop = min(found)
        self.text = self.text[:i + len(stop) if self.params.include_stop_str_in_output else i]
        self.finished, self.finish_reason, self.stop_reason = True, "stop", stop

    def _take_text(self) -> str:
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._holdback)
        delta, self._sent = self.text[self._sent:end], end
        return delta


class RequestState:
    """One client request: its n samples, each an engine request, by engine request id."""

    def __init__(self, request_id: str, params: SamplingParams, tokenizer: Tokenizer | None,
                 streaming: bool = True) -> None:
        """`streaming` False (LLM.generate): the text is decoded once, at the end, unless stop strings
        must be watched for on the way."""
        self.request_id = request_id
        self.engine_requests = fan_out(request_id, params)
        self.samples = {rid: SampleStream(i, p, tokenizer, streaming=streaming)
                        for i, (rid, p) in enumerate(self.engine_requests)}
        self.prompt_output: RequestOutput | None = None  # the first output: prompt ids and logprobs

    def process(self, out: RequestOutput) -> SampleDelta | None:
        """`out`'s delta for its sample; the caller aborts `out.request_id` in the engine when the delta
        finished it and the engine has not (`needs_abort`)."""
        if self.prompt_output is None:
            self.prompt_output = out
        return self.samples[out.request_id].process(out)

    def take(self, out: RequestOutput, abort: Callable[[str, str], None]) -> SampleDelta | None:
        """The output loop's one step, for LLM, gRPC and HTTP alike: `out`'s delta, and when the delta
        finished its sample while the engine still runs it (a stop string), `abort(request_id, "stop")`."""
        delta = self.process(out)
        if needs_abort(out, delta):
            abort(out.request_id, "stop")
        return delta

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples.values())

    @property
    def group(self) -> str | None:
        return self.request_id if len(self.samples) > 1 else None


def needs_abort(out: RequestOutput, delta: SampleDelta | None) -> bool:
    """The edge finished the sample (a stop string) while the engine still runs it."""
    return delta is not None and delta.finished and not out.finished
