"""The OpenAI-compatible HTTP API: FastAPI routes served by uvicorn on the gRPC server's asyncio loop.

    GET  /v1/models  /health  /version  /metrics  /tokenizer_info
    POST /v1/completions  /v1/chat/completions  /tokenize  /detokenize

One process, one engine: `Server` (serving/lifecycle.py) starts this beside gRPC and attaches both to
the same `EngineLoop`. A request moves as a gRPC call does, through the same admission
(`serving/admission.py`): read here into prompts and `SamplingParams` (bad values refused with a 400
naming the field), the prompts checked and tokenized, one slot of the shared `--max-queue-size` taken
(429 beyond), its engine requests (n samples, each prompt of a batch) added with a sink that posts
outputs to this loop, and each output turned into text at the edge (`jaxcpp.output_processor`) and sent
as a server-sent event (`data: {...}`, ending with `data: [DONE]`) or gathered into one JSON body.
Whatever ends a call early (a client that disconnects, a stream it stops reading, shutdown) aborts its
engine requests, and their pages are free before the next step. `serving/http_errors.py` maps
admission's errors (and every other) to HTTP statuses and error objects; the checks before a body is
parsed (API key, sizes, timeouts), the listener and the SSE framing are `serving/http_edge.py`'s.

Why FastAPI + uvicorn: the stack vLLM and SGLang serve the same API with, so their clients' quirks
are already met; FastAPI gives typed bodies and an OpenAPI page (/docs) for free, and uvicorn's
`Server.serve()` is a coroutine, so it shares the asyncio loop grpc.aio already runs: no second loop,
no thread per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import jaxcpp
from jaxcpp.config import ServerConfig
from jaxcpp.core.outputs import ModelInfo, RequestOutput, TokenLogprobs
from jaxcpp.errors import InvalidRequestError
from jaxcpp.output_processor import RequestState, SampleDelta, SampleStream
from jaxcpp.serving.admission import Admission, OutputStream, PromptTooLargeError, Refused
from jaxcpp.serving.chat_template import ChatTemplate, NoChatTemplateError
from jaxcpp.serving.engine_loop import EngineLoop
from jaxcpp.serving.http_edge import listen, sse, until_disconnected
from jaxcpp.serving.http_errors import add_error_handlers, openai_error
from jaxcpp.serving.metrics import ServingMetrics
from jaxcpp.serving.openai_protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    Prompt,
    TokenizeRequest,
    check_text,
)
from jaxcpp.serving.tool_calls import ToolCalling, ToolStream, merge, template_messages
from jaxcpp.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

Event = dict[str, Any]
Entries = list[TokenLogprobs | None] | None  # logprobs as the API lists them (None: the first prompt token)


class OpenAIServer:
    """The HTTP front end. `start()` listens (503 "warming up" until `attach`), `close()` refuses new
    requests (drain), `stop()` ends the listener."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics, admission: Admission,
                 api_key: str | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.port = 0
        self._admission = admission  # shared with gRPC: one registry, one queue limit
        self._engine: EngineLoop | None = None
        self._info: ModelInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._chat_template: ChatTemplate | None = None
        self._names: tuple[str, ...] = ()
        self._closing = False
        self._api_key = api_key  # the key requests must send (None: none), read at start-up (security.py)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.app = self._routes()

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> int:
        self._server, self._task, self.port = await listen(self.app, self.config, self._api_key)
        return self.port

    def attach(self, engine_loop: EngineLoop, info: ModelInfo, tokenizer: Tokenizer | None,
               chat_template: ChatTemplate | None, served_names: tuple[str, ...]) -> None:
        self._engine, self._info, self._tokenizer = engine_loop, info, tokenizer
        self._chat_template, self._names = chat_template, served_names

    def close(self) -> None:
        """Refuse new requests with 503 (shutdown); calls in flight go on."""
        self._closing = True

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait({self._task}, timeout=5.0)

    # ---- routes --------------------------------------------------------------------------------
    def _routes(self) -> FastAPI:
        app = FastAPI(title="jaxcpp", version=jaxcpp.__version__, docs_url="/docs", redoc_url=None)
        add_error_handlers(app)
        guarded = [Depends(self._authorize)]
        app.get("/health")(self._health)
        app.get("/version")(lambda: {"version": jaxcpp.__version__})
        app.get("/metrics")(lambda: Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST))
        app.get("/v1/models", dependencies=guarded)(self._models)
        app.get("/tokenizer_info", dependencies=guarded)(self._tokenizer_info)
        app.post("/tokenize", dependencies=guarded)(self._tokenize)
        app.post("/detokenize", dependencies=guarded)(self._detokenize)
        app.post("/v1/completions", dependencies=guarded)(self._completions)
        app.post("/v1/chat/completions", dependencies=guarded)(self._chat_completions)
        return app

    async def _authorize(self, request: Request) -> None:
        """503 while warming up or draining. (The key, 401, and the body's size, 413, were checked before
        the body was read: `jaxcpp.serving.http_edge`.)"""
        if self._closing:
            raise OpenAIError(503, "the server is shutting down")
        if self._engine is None:
            raise OpenAIError(503, "warming up: the engine is loading the model and compiling; retry when "
                                   "/health answers 200")
        if self._engine.failure is not None:
            raise OpenAIError(503, f"engine failed: {self._engine.failure!r}")
        if (unready := self._engine.unready_reason()) is not None:  # a kv_consumer without a ready producer
            raise OpenAIError(503, unready)

    async def _health(self) -> Response:
        ready = self._engine is not None and not self._closing and self._engine.failure is None \
            and self._engine.unready_reason() is None
        return PlainTextResponse("" if ready else "not serving", status_code=200 if ready else 503)

    async def _models(self) -> dict[str, Any]:
        assert self._info is not None
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "jaxcpp", "root": self._info.name,
             "max_model_len": self._info.max_model_len, "kv_cache_dtype": self._info.kv_cache_dtype}
            for name in self._names]}

    async def _tokenizer_info(self) -> dict[str, Any]:
        """What lm-evaluation-harness's remote tokenizer reads (with /tokenize and /detokenize)."""
        assert self._info is not None
        return {"tokenizer_class": type(self._tokenizer).__name__, "eos_token": None, "bos_token": None,
                "pad_token": None, "eos_token_ids": list(self._info.eos_token_ids),
                "model_max_length": self._info.max_model_len,
                "chat_template": self._chat_template.source if self._chat_template else None}

    async def _tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        check_text(body)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", "prompt")
        text = body.prompt if body.prompt is not None else \
            self._render([m.for_template() for m in body.messages or ()], body.add_generation_prompt, None)
        assert self._info is not None
        tokens = self._admission.tokenize(text, "prompt")
        return {"count": len(tokens), "max_model_len": self._info.max_model_len, "tokens": tokens}

    async def _detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        if self._tokenizer is None:
            raise InvalidRequestError("tokens", "this model folder has no tokenizer.json: nothing to decode with")
        return {"prompt": self._tokenizer.decode(body.tokens)}

    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        check_text(body)
        self._check_model(body.model)
        call_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            body.check_unsupported()
            prompts = [self._prompt_ids(p, "prompt") for p in body.prompts()]
            logprobs, prompt_logprobs = body.logprob_counts()
            states = [RequestState(f"{call_id}-{i}", body.sampling_params(
                body.max_tokens if body.max_tokens is not None else self._room(ids), logprobs, prompt_logprobs),
                self._tokenizer) for i, ids in enumerate(prompts)]
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e, COMPLETION_FIELDS) from None
        call = _Call(call_id, "text_completion", body.model or self._names[0], states, prompts, body.n,
                     self._tokenizer, echo=body.echo)
        return await self._respond(call, request, body.stream, body.include_usage, COMPLETION_FIELDS)

    async def _chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        check_text(body)
        self._check_model(body.model)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            tools = ToolCalling.of(body.tools, body.tool_choice, body.parallel_tool_calls,
                                   self.config.enable_auto_tool_choice, self.config.tool_call_parser)
            text = self._render(template_messages([m.for_template() for m in body.messages]),
                                body.add_generation_prompt, {**({"tools": tools.tools} if tools else {}),
                                                             **(body.chat_template_kwargs or {})})
            ids = self._prompt_ids(text, "messages")
            max_tokens = body.requested_max_tokens()
            params = body.sampling_params(max_tokens if max_tokens is not None else self._room(ids),
                                          body.logprob_count(), None)
            params = tools.constrain(params) if tools is not None else params
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e, CHAT_FIELDS) from None
        call = _Call(call_id, "chat.completion", body.model or self._names[0],
                     [RequestState(call_id, params, self._tokenizer)], [ids], body.n, self._tokenizer, chat=True,
                     tools=tools if tools is not None and tools.makes_calls else None)
        return await self._respond(call, request, body.stream, body.include_usage, CHAT_FIELDS)

    # ---- one call ------------------------------------------------------------------------------
    async def _respond(self, call: _Call, request: Request, stream: bool, include_usage: bool,
                       fields: dict[str, str]) -> Response:
        try:  # every prompt's requests queued at once: they join the engine before its next step, together
            output = await self._admission.admit(call.id, call.states, call.prompts)
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e, fields) from None
        except Refused as e:
            if e.kind == "full":
                self.metrics.rejected.labels("429").inc()
            raise openai_error(e) from None
        events = self._events(call, output, include_usage)
        if stream:
            return StreamingResponse(sse(events), media_type="text/event-stream")
        return JSONResponse(await until_disconnected(request, self._gather(call, events)))

    async def _events(self, call: _Call, output: OutputStream, include_usage: bool) -> AsyncIterator[Event]:
        """The call's stream chunks, in order; its engine requests are aborted however it ends."""
        try:
            async for prompt_index, state, out, delta in self._admission.deltas(output, call.states):
                if delta.token_ids or delta.text or delta.finished:
                    yield call.chunk(prompt_index, state, out, delta)
            if include_usage:
                yield {**call.header("chunk"), "choices": [], "usage": call.usage()}
        except Refused as e:
            raise openai_error(e) from None
        finally:
            self._admission.leave(output)

    async def _gather(self, call: _Call, events: AsyncIterator[Event]) -> Event:
        async for _ in events:
            pass
        return call.response()

    # ---- prompts -------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._names:
            raise OpenAIError(404, f"model {model!r} does not exist; this server serves {', '.join(self._names)}",
                              "model", "model_not_found")

    def _prompt_ids(self, prompt: Prompt, field: str) -> list[int]:
        try:
            return self._admission.prompt_ids(prompt, field)
        except PromptTooLargeError as e:
            raise OpenAIError(413, str(e), field) from None

    def _room(self, prompt: list[int]) -> int:
        """max_tokens when the client gives none (chat): whatever the model length leaves."""
        assert self._info is not None
        return max(1, self._info.max_model_len - len(prompt))

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: dict[str, Any] | None) -> str:
        if self._chat_template is None:
            raise NoChatTemplateError(self._names[0])
        return self._chat_template.render(messages, add_generation_prompt, kwargs)


class _Call:
    """One HTTP call's samples (n per prompt, prompts of a batch), as chunks and as one response."""

    def __init__(self, call_id: str, kind: str, model: str, states: list[RequestState], prompts: list[list[int]],
                 n: int, tokenizer: Tokenizer | None, *, echo: bool = False, chat: bool = False,
                 tools: ToolCalling | None = None) -> None:
        self.id, self.kind, self.model, self.states, self.prompts = call_id, kind, model, states, prompts
        self.n, self.echo, self.chat = n, echo, chat
        self.tools = tools  # calls to parse out of the text (jaxcpp.serving.tool_calls)
        self._tool_streams: dict[int, ToolStream] = {}
        self.created = int(time.time())
        self._started: set[int] = set()  # choices whose first chunk went out
        self._tokenizer = tokenizer

    def header(self, suffix: str = "") -> Event:
        kind = f"{self.kind}.{suffix}" if suffix and self.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> Event:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(s.token_ids) for state in self.states for s in state.samples.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- streaming
    def chunk(self, prompt_index: int, state: RequestState, out: RequestOutput, delta: SampleDelta) -> Event:
        index = prompt_index * self.n + delta.index
        first = index not in self._started
        self._started.add(index)
        finish = {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason} if delta.finished \
            else {"finish_reason": None}
        if self.chat:
            message: Event = {"content": delta.text}
            if self.tools is not None:
                stream = self._tool_streams.setdefault(index, ToolStream(self.tools))
                message = merge(stream.feed(delta.text, delta.finished))
                if delta.finished:
                    finish["finish_reason"] = self.tools.finish_reason(delta.finish_reason, stream.made_calls)
            message = {"role": "assistant", **message} if first else message
            logprobs = _chat_logprobs(self._tokenizer, delta.logprobs)
            return {**self.header("chunk"), "choices": [{"index": index, "delta": message, "logprobs": logprobs,
                                                         **finish}]}
        text, entries = delta.text, _entries(delta.logprobs)
        if self.echo and first:
            text, entries = self._echoed(state, out, text, entries)
        return {**self.header(), "choices": [{"index": index, "text": text,
                                              "logprobs": _completion_logprobs(self._tokenizer, entries), **finish}]}

    def _echoed(self, state: RequestState, out: RequestOutput, text: str, entries: Entries) -> tuple[str, Entries]:
        prompt_text = self._tokenizer.decode(out.prompt_token_ids) if self._tokenizer is not None else ""
        if entries is not None:
            first = TokenLogprobs(out.prompt_token_ids[0], float("nan"))  # the first token has none: None
            entries = [first, *((state.prompt_output or out).prompt_logprobs or []), *entries]
        return prompt_text + text, entries

    # -- one body
    def response(self) -> Event:
        choices = []
        for p, state in enumerate(self.states):
            for sample in state.samples.values():
                choices.append(self._choice(p * self.n + sample.index, state, sample))
        return {**self.header(), "choices": choices, "usage": self.usage()}

    def _choice(self, index: int, state: RequestState, sample: SampleStream) -> Event:
        finish = {"finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
        entries: Entries = list(sample.logprobs) if sample.params.logprobs is not None else None
        if self.chat:
            message = {"role": "assistant", "content": sample.text}
            if self.tools is not None:
                message = self.tools.message(sample.text)
                finish["finish_reason"] = self.tools.finish_reason(sample.finish_reason, "tool_calls" in message)
            return {"index": index, "message": message,
                    "logprobs": _chat_logprobs(self._tokenizer, entries), **finish}
        text = sample.text
        if self.echo and state.prompt_output is not None:
            text, entries = self._echoed(state, state.prompt_output, text, entries)
        return {"index": index, "text": text, "logprobs": _completion_logprobs(self._tokenizer, entries), **finish}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """A token as text; a token that is no text alone (a special token, part of a UTF-8 character)
    as "token_id:N", vLLM's spelling, so that no two tokens read the same."""
    text = tokenizer.decode([token_id]) if tokenizer is not None else ""
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"


def _token_bytes(tokenizer: Tokenizer | None, token_id: int) -> list[int] | None:
    if isinstance(tokenizer, ByteTokenizer) and token_id < ByteTokenizer.NUM_BYTES:
        return [token_id]
    text = tokenizer.decode([token_id]) if tokenizer is not None else ""
    return list(text.encode()) if text else None


def _finite(x: float) -> float | None:
    return None if x != x else x  # NaN marks the first prompt token, which has no log-probability


def _entries(logprobs: list[TokenLogprobs] | None) -> Entries:
    return None if logprobs is None else list(logprobs)


def _completion_logprobs(tok: Tokenizer | None, entries: Entries) -> Event | None:
    """The completions API's shape; the sampled token is among its top entries, as vLLM returns them."""
    if entries is None:
        return None
    tokens = [_token_text(tok, e.token_id) for e in entries if e is not None]
    offsets = [0]
    for t in tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    tops = [None if e is None or not e.top and e.logprob != e.logprob else
            {**{_token_text(tok, t): lp for t, lp in e.top}, _token_text(tok, e.token_id): e.logprob}
            for e in entries]
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) if e else None for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: Tokenizer | None, entries: Iterable[TokenLogprobs | None] | None) -> Event | None:
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> Event:
        return {"token": _token_text(tok, token_id), "logprob": logprob, "bytes": _token_bytes(tok, token_id)}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries if e is not None]}
