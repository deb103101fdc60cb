"""Admission: the one way in to the engine for both front ends, and the one way out of it.

A front end is a protocol adapter: the gRPC servicer (`serving/server.py`) and the OpenAI HTTP API
(`serving/openai_server.py`) each read their request into prompts and `SamplingParams`, call this
module, and turn what comes back (deltas, or an error) into their own messages and status codes.
Everything else a call goes through is here, once, on the server's asyncio loop:

    prompt_ids   the prompt-size check (`--max-prompt-bytes`, UTF-8 bytes, before tokenizing) and the
                 tokenization; an empty prompt is the engine's to refuse (`check_request`), for every
                 front end alike
    admit        the queue limit (`--max-queue-size` calls of both front ends together), a call id in
                 flight at most once, the call registered, its engine requests (the n samples of each
                 prompt) handed to the engine thread together, or none of them
    deltas       the output loop: each engine output becomes its sample's delta (`RequestState.take`),
                 an engine failure becomes one error, `EngineFailure`, that each adapter maps to its status
    leave        the clean-up however a call ends: its engine requests aborted (pages free before the
                 next step), the call dropped from the registry
A client that stops reading is cut off here too (`OutputStream`): its requests are aborted and its
slot released at once, and the adapter is told, to end the call its own way.

Tokenization runs on the asyncio loop, for both front ends: the engine thread is everyone's (a long
prompt tokenized there holds every running request's next step), the loop already detokenizes every
output (`jaxcpp.output_processor`), and a prompt reaches the tokenizer only once its size passed
`--max-prompt-bytes`. The API key and TLS, which are the transport's, have their one place in
`serving/security.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxcpp.config import ServerConfig
from jaxcpp.core.executor import ExecutorError
from jaxcpp.core.outputs import RequestOutput
from jaxcpp.errors import InvalidRequestError
from jaxcpp.output_processor import RequestState, SampleDelta
from jaxcpp.serving.engine_loop import EngineFailedError, EngineLoop, Sink
from jaxcpp.serving.metrics import ServingMetrics
from jaxcpp.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]


class PromptTooLargeError(InvalidRequestError):
    """A prompt's text over `--max-prompt-bytes` (HTTP answers 413, gRPC INVALID_ARGUMENT)."""


class Refused(Exception):  # noqa: N818 - what happened to the call, as the adapters read it
    """A call admission would not take, or that it ended; `kind` is what each adapter maps to a status:

        full         the queue limit (RESOURCE_EXHAUSTED, 429)
        duplicate    the call id is in flight already (ALREADY_EXISTS, 409)
        stalled      the client stopped reading (RESOURCE_EXHAUSTED, 500)
        unavailable  the engine is gone, or lost a pipeline stage, or no producer could prefill the
                     request (a kv_consumer's): retry (UNAVAILABLE, 503)
        failed       the engine failed this request, or failed with an unknown error (INTERNAL, 500)
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EngineFailure(Refused):
    """The engine failed the call (kinds "unavailable" and "failed")."""

    @classmethod
    def of(cls, error: BaseException) -> EngineFailure:
        if isinstance(error, EngineFailedError):  # the engine loop stopped: no engine to take the call
            return cls("unavailable", str(error))
        if isinstance(error, ExecutorError):  # a lost pipeline stage is the server's loss, not the request's
            return cls("unavailable", f"engine failed: {error}")
        return cls("failed", f"engine failed: {error!r}")


class OutputStream:
    """One call's engine outputs, queued on its asyncio loop until the adapter sends them.

    `sink()` is what the engine thread calls (it posts to the loop). Past `limit` queued outputs per
    engine request (each sample of each prompt: a call of 1,000 prompts or n = 64 gets 1,000 or 64
    times the room, as its outputs come that many at a time) while the call's reader is busy sending,
    the client is not reading: the stream stalls and `on_stalled` aborts its requests. While the reader
    waits in `next()` the queue is the loop's lag, not the client's: outputs posted while the loop ran
    something else arrive together (a wide call's reader on a busy loop met hundreds at once), so
    that is never a stall. What a stalled reader holds is so bounded by the work its call asked for,
    which the engine holds anyway (each request's tokens)."""

    def __init__(self, request_id: str, limit: int, on_stalled: Callable[[OutputStream], None],
                 context: Any = None) -> None:
        self.request_id = request_id
        self.engine_request_ids = [request_id]  # one per sample
        self.context = context                  # the front end's handle on the call
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.stalled = False
        self.waiting = False                    # the reader is in next(): whatever is queued, it reads
        self.max_backlog = 0
        self.end_task: asyncio.Future[None] | None = None
        self.handler_task = asyncio.current_task()  # created inside the handler
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._on_stalled = on_stalled

    def sink(self) -> Sink:
        def post(out: RequestOutput | BaseException) -> None:  # engine thread
            self._loop.call_soon_threadsafe(self.deliver, out)

        return post

    def deliver(self, out: RequestOutput | BaseException) -> None:  # asyncio loop
        if self.stalled:
            return
        self.outputs.put_nowait(out)
        self.max_backlog = max(self.max_backlog, self.outputs.qsize())
        if self.outputs.qsize() > self.limit and not self.waiting:
            self.stalled = True
            self._on_stalled(self)

    async def next(self) -> RequestOutput | BaseException:
        """The next output (or what ended the stream), as the call's reader takes it."""
        self.waiting = True
        try:
            return await self.outputs.get()
        finally:
            self.waiting = False

    @property
    def limit(self) -> int:
        """Outputs this call may have queued: `--max-stream-buffer` per engine request."""
        return self._limit * max(1, len(self.engine_request_ids))

    def abort(self, engine: EngineLoop) -> None:
        """Abort every sample's engine request (finished ones: no-op): the pages are freed before the next step."""
        for request_id in self.engine_request_ids:
            engine.abort(request_id)


# What an adapter does when its client stopped reading, after admission aborted the call and released
# its slot: end the call its own way (gRPC from aside, as its handler is stuck in a write).
OnStalled = Callable[[OutputStream, str], None]


class Admission:
    """The in-flight registry of both front ends, the queue limit over it, and what a call goes through.
    Touched on the server's asyncio loop only. `attach` hands it the engine once it is built."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._in_flight: dict[str, OutputStream] = {}  # call id -> its outputs
        self._engine: EngineLoop | None = None
        self.tokenizer: Tokenizer | None = None
        self.max_stream_backlog = 0  # high-water mark of any call's queued outputs (tests, soak)

    def attach(self, engine_loop: EngineLoop) -> None:
        self._engine, self.tokenizer = engine_loop, engine_loop.engine.tokenizer

    @property
    def num_in_flight(self) -> int:
        """Calls held by both front ends."""
        return len(self._in_flight)

    # ---- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt, field: str) -> list[int]:
        """A prompt as token ids: text refused over `--max-prompt-bytes`, then tokenized (empty text is
        an empty prompt, BOS or not, as the engine reads it). Raises InvalidRequestError naming `field`."""
        if isinstance(prompt, list):
            return prompt
        limit = self._config.max_prompt_bytes
        # len(text) <= UTF-8 size <= 4 * len(text): the first test avoids encoding a huge prompt
        if len(prompt) > limit or len(prompt.encode("utf-8", "surrogatepass")) > limit:
            raise PromptTooLargeError(field, f"prompt text is over --max-prompt-bytes {limit} (UTF-8 bytes)")
        return self.tokenize(prompt, field) if prompt else []

    def tokenize(self, text: str, field: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(field, "this model folder has no tokenizer.json: send token ids")
        return self.tokenizer.encode(text)

    # ---- one call ------------------------------------------------------------------------------
    async def admit(self, call_id: str, states: list[RequestState], prompts: list[list[int]],
                    kv_transfer: Any = None, context: Any = None,
                    on_stalled: OnStalled | None = None) -> OutputStream:
        """Register the call and add its engine requests (every prompt's samples join the engine before
        its next step, together), or raise: `Refused` (full, duplicate), `EngineFailure` (no engine),
        InvalidRequestError (the engine refused a request: nothing of the call was admitted).
        The caller must `leave(stream)` however the call ends."""
        engine = self._engine
        assert engine is not None, "admit before attach"
        if (held := len(self._in_flight)) >= self._config.max_queue_size:
            raise Refused("full", f"request queue is full: {held} requests in flight "
                                  f"(--max-queue-size {self._config.max_queue_size}); retry later")
        if call_id in self._in_flight:
            raise Refused("duplicate", f"request_id: {call_id!r} is already in flight")
        stream = OutputStream(call_id, self._config.max_stream_buffer,
                              lambda s: self._stalled(s, on_stalled), context)
        stream.engine_request_ids = [rid for state in states for rid, _ in state.engine_requests]
        self._in_flight[call_id] = stream
        self._metrics.set_in_flight(len(self._in_flight))
        try:
            added = await asyncio.gather(*(asyncio.wrap_future(engine.add_samples(s, ids, stream.sink(), kv_transfer))
                                           for s, ids in zip(states, prompts, strict=True)), return_exceptions=True)
            refused = next((e for e in added if isinstance(e, BaseException)), None)
            if refused is not None:
                raise refused
        except EngineFailedError as e:
            self.leave(stream)
            raise EngineFailure.of(e) from None
        except BaseException:
            self.leave(stream)
            raise
        return stream

    async def deltas(self, stream: OutputStream, states: list[RequestState]
                     ) -> AsyncIterator[tuple[int, RequestState, RequestOutput, SampleDelta]]:
        """The call's sample deltas in order, as (prompt index, its state, the output, the delta), until
        every sample finished; raises `Refused` when the engine failed or the client stopped reading."""
        assert self._engine is not None
        abort = self._engine.abort
        by_id = {rid: (i, state) for i, state in enumerate(states) for rid, _ in state.engine_requests}
        while not all(state.finished for state in states):
            out = await stream.next()
            if isinstance(out, Refused):  # put there by `_stalled`
                raise out
            if isinstance(out, BaseException):
                raise EngineFailure.of(out)
            if out.finish_reason == "error":  # the engine failed this request and carries on; retrying may
                kind = "unavailable" if out.unavailable else "failed"  # help when no producer could prefill it
                raise EngineFailure(kind, f"engine failed this request: {out.error}")
            i, state = by_id[out.request_id]
            delta = state.take(out, abort)
            if delta is not None:
                yield i, state, out, delta

    def leave(self, stream: OutputStream) -> None:
        """However a call ends: abort its engine requests (a no-op for finished ones) and drop it."""
        if self._engine is not None and not stream.stalled:  # a stalled call's were aborted already
            stream.abort(self._engine)
        self.max_stream_backlog = max(self.max_stream_backlog, stream.max_backlog)
        if self._in_flight.get(stream.request_id) is stream:
            del self._in_flight[stream.request_id]
        self._metrics.set_in_flight(len(self._in_flight))

    def _stalled(self, stream: OutputStream, on_stalled: OnStalled | None) -> None:
        """A client stopped reading: free its pages and its queue slot now, then let its adapter end it."""
        queued = stream.outputs.qsize()
        log.warning("request %r: client is not reading (%d outputs queued); aborting", stream.request_id, queued)
        if self._engine is not None:
            stream.abort(self._engine)
        self.leave(stream)
        message = (f"client is not reading: {queued} outputs queued (--max-stream-buffer "
                   f"{self._config.max_stream_buffer} per sample); request aborted")
        stream.outputs.put_nowait(Refused("stalled", message))  # what the call's reader finds next
        if on_stalled is not None:
            on_stalled(stream, message)
