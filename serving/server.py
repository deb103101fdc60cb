"""The gRPC front end: `jaxcpp.v1.JaxcppService`, a thin adapter on the shared admission path.

How a Generate call moves: the handler (on the asyncio loop) reads the request into a prompt and
`SamplingParams` (a bad field: INVALID_ARGUMENT naming it), and `serving/admission.py` does the rest
that HTTP calls go through too: the prompt-size check and tokenization, a slot in the shared queue
(`--max-queue-size` calls of both front ends, RESOURCE_EXHAUSTED beyond), the request handed to the
`EngineLoop` thread with a sink that posts each `RequestOutput` back onto the asyncio loop, and each
output detokenized into its sample's delta, which the handler streams as it arrives. Whatever ends
the call early (client cancel, disconnect, deadline, shutdown) cancels the handler, whose `finally`
leaves the admission: the abort runs on the engine thread before its next step. No thread per stream:
one asyncio loop, one engine thread, and prometheus-client's HTTP thread. An engine failure comes
back as one error (`EngineFailure`), which `_STATUS` maps to its status code.

Backpressure: a client that stops reading fills gRPC's flow-control window, the handler's write
blocks and the stream's outputs pile up in its queue. Past `--max-stream-buffer` queued outputs the
request is aborted in the engine (its pages freed), its queue slot released, and the call ended with
RESOURCE_EXHAUSTED from a separate task (the handler itself is stuck in the blocked write).

What answers before the servicer (API key, undecodable bytes, warm-up) is `serving/grpc_edge.py`;
start-up and shutdown are `serving/lifecycle.py`'s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

import jaxcpp
from jaxcpp.config import ServerConfig
from jaxcpp.core.outputs import ModelInfo, RequestOutput, TokenLogprobs
from jaxcpp.errors import InvalidRequestError
from jaxcpp.output_processor import RequestState, SampleDelta
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.admission import Admission, OutputStream, Prompt, Refused
from jaxcpp.serving.disaggregation import kv_transfer_from_proto, layout_to_proto, offer_to_proto
from jaxcpp.serving.engine_loop import EngineFailedError, EngineLoop
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.metrics import ServingMetrics, split_dynamic_chunking
from jaxcpp.structured.constraint import StructuredOutputs

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxcppService"].full_name
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}
MAX_REQUEST_ID_CHARS = 256  # echoed in every response message, so it is kept short
_STATUS = {"full": grpc.StatusCode.RESOURCE_EXHAUSTED, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
           "stalled": grpc.StatusCode.RESOURCE_EXHAUSTED, "unavailable": grpc.StatusCode.UNAVAILABLE,
           "failed": grpc.StatusCode.INTERNAL}  # `Refused.kind` -> the status a call ends with


_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "min_p", "min_tokens",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                             "prompt_logprobs")


def sampling_params_from_proto(msg: pb.SamplingParameters) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; raises InvalidRequestError naming the field."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, stop=tuple(msg.stop),
                          include_stop_str_in_output=msg.include_stop_str_in_output, **kwargs)


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The proto's one kind of constraint; raises InvalidRequestError naming the field."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", "set one of json, json_object, regex, choice, grammar")
    if kind == "json":
        return StructuredOutputs.from_schema(msg.json)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.values))
    return StructuredOutputs(**{kind: getattr(msg, kind)})


def prompt_from_proto(request: pb.GenerateRequest) -> tuple[Prompt, str]:
    """The prompt and the field it came in (for errors about it)."""
    kind = request.WhichOneof("prompt")
    if kind is None:  # an empty one is the engine's to refuse (`check_request`), as for every front end
        raise InvalidRequestError("prompt", "must be set: `text` or `token_ids`")
    return (request.text, "text") if kind == "text" else (list(request.token_ids.ids), "token_ids")


def request_id_from_proto(request: pb.GenerateRequest) -> str:
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, "
                                  f"got {len(request.request_id)}")
    return request.request_id or uuid.uuid4().hex


class JaxcppServicer(pb_grpc.JaxcppServiceServicer):
    """Registered before the engine exists; `attach` hands it the engine (`grpc_edge.WarmUpGate` holds calls
    until then)."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics, admission: Admission) -> None:
        self._engine: EngineLoop  # set by attach()
        self._model_info: ModelInfo
        self._config = config
        self._metrics = metrics
        self._admission = admission
        self._started = time.monotonic()
        self._closing = False

    def attach(self, engine_loop: EngineLoop, model_info: ModelInfo) -> None:
        self._engine = engine_loop
        self._model_info = model_info

    def close(self) -> None:
        """Refuse new Generate calls (shutdown)."""
        self._closing = True

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if (unready := self._engine.unready_reason()) is not None:  # a kv_consumer without a ready producer
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, unready)
        admission = self._admission
        try:
            params = sampling_params_from_proto(request.sampling)
            prompt = admission.prompt_ids(*prompt_from_proto(request))
            request_id = request_id_from_proto(request)
        except InvalidRequestError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        kv_transfer = None
        if request.HasField("kv_transfer"):  # a consumer's prefill (disaggregation)
            kv_transfer, refused = kv_transfer_from_proto(request.kv_transfer, self._model_info, context.peer())
            if refused is not None:
                await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, refused)
        state = RequestState(request_id, params, admission.tokenizer)
        try:
            stream = await admission.admit(request_id, [state], [prompt], kv_transfer, context, self._on_stalled)
        except InvalidRequestError as exc:  # the engine refused it
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            await self._end(context, exc, counted=exc.kind in ("full", "duplicate"))
        try:
            async for _, _, out, delta in admission.deltas(stream, [state]):
                yield self._response(request_id, out, delta)
        except Refused as exc:
            await self._end(context, exc)
        finally:  # cancelled, disconnected, deadline, grace over: the engine requests aborted (finished: no-op)
            admission.leave(stream)

    def _on_stalled(self, stream: OutputStream, message: str) -> None:
        """A client stopped reading (admission aborted it and freed its slot): end the call from aside."""
        self._metrics.rejected.labels(grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
        stream.end_task = asyncio.ensure_future(_abort_call(stream, message))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        info = self._model_info
        return pb.GetModelInfoResponse(
            name=info.name, architecture=info.architecture, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, num_layers=info.num_layers, hidden_size=info.hidden_size,
            dtype=info.dtype, page_size=info.page_size,
            max_num_batched_tokens=info.max_num_batched_tokens,
            pipeline_parallel_size=info.pipeline_parallel_size,
            tensor_parallel_size=info.tensor_parallel_size,
            eos_token_ids=list(info.eos_token_ids), server_version=jaxcpp.__version__,
            kv_cache_dtype=info.kv_cache_dtype, kv_role=info.kv_role,
            kv_layout=layout_to_proto(info.kv_layout) if info.kv_layout is not None else None)

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetServerStatsResponse:
        try:
            s = await asyncio.wrap_future(self._engine.submit(self._engine.engine.stats))
        except EngineFailedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        values, labels = split_dynamic_chunking(s.dynamic_chunking)
        return pb.GetServerStatsResponse(
            **s.counts(), num_in_flight=self._admission.num_in_flight,
            max_queue_size=self._config.max_queue_size,
            dynamic_chunking=pb.DynamicChunkingStats(values=values, labels=labels),
            uptime_s=time.monotonic() - self._started)

    def _response(self, request_id: str, out: RequestOutput, delta: SampleDelta) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                                       index=delta.index, logprobs=_logprobs_proto(delta.logprobs))
        if out.prompt_logprobs is not None and len(delta.token_ids) == out.num_generated:  # its first message
            response.prompt_logprobs.extend(_logprobs_proto(out.prompt_logprobs))
        if delta.finished:
            m = out.metrics
            response.finish_reason = _FINISH_REASONS.get(delta.finish_reason or "",
                                                         pb.FINISH_REASON_UNSPECIFIED)
            response.num_prompt_tokens = len(out.prompt_token_ids)
            response.num_generated_tokens = out.num_generated
            response.ttft_s = m.ttft or 0.0
            response.e2e_s = m.e2e or (time.monotonic() - m.arrival_time)
            response.num_cached_tokens = out.num_cached_tokens
            response.stop_string = delta.stop_reason if isinstance(delta.stop_reason, str) else ""
            if out.kv_offer is not None:
                response.kv_offer.CopyFrom(offer_to_proto(out.kv_offer))
        return response

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self._metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    async def _end(self, context: grpc.aio.ServicerContext, refused: Refused, counted: bool = False) -> None:
        if counted:
            self._metrics.rejected.labels(_STATUS[refused.kind].name).inc()
        await context.abort(_STATUS[refused.kind], str(refused))


async def _abort_call(stream: OutputStream, message: str) -> None:
    """End a call whose handler is blocked in a write. The handler is cancelled first (were the status
    sent first, its pending write would fail and gRPC would log that as an error), then the status goes
    out behind what the transport still buffers."""
    task = stream.handler_task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
    try:
        await stream.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    except BaseException:  # noqa: B036 - abort always raises AbortError; the call is over either way
        pass


def _logprobs_proto(entries: list[TokenLogprobs] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top]) for e in entries or ()]
