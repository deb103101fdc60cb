"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, in the manner of vLLM.

    with LLM(model="tiny") as llm:          # closing releases the executor (threads, trace, devices)
        outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from jaxcpp.config import EngineConfig
from jaxcpp.core.engine import LLMEngine
from jaxcpp.core.executor import Executor
from jaxcpp.core.outputs import RequestOutput
from jaxcpp.logs import show_startup_progress
from jaxcpp.output_processor import RequestState, SampleStream
from jaxcpp.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str = "tiny", *, record_logits: bool = False, executor: Executor | None = None,
                 **engine_kwargs: Any) -> None:
        """Keyword arguments are engine flags by their field names (`max_num_batched_tokens=512`);
        `executor` replaces the real one (e.g. `jaxcpp.core.fake_executor.FakeExecutor`)."""
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        for warning in config.startup_warnings():  # this edge built the config (`jaxcpp` logs its own)
            log.warning(warning)
        self._start(config, record_logits, executor)

    @classmethod
    def from_config(cls, config: EngineConfig, *, record_logits: bool = False,
                    executor: Executor | None = None) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, record_logits, executor)
        return llm

    def _start(self, config: EngineConfig, record_logits: bool, executor: Executor | None) -> None:
        show_startup_progress()  # a sign of life while weights load and every bucket compiles (jaxcpp.logs)
        self.engine = LLMEngine(config, executor, record_logits=record_logits)
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. With n > 1 a
        prompt's output is its first sample's, and `.samples` holds all n."""
        inputs = self._inputs(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(inputs))
        requests = [RequestState(f"offline-{next(self._ids)}", p, self.engine.tokenizer, streaming=False)
                    for p in params]
        by_engine_id = {rid: r for r in requests for rid, _ in r.engine_requests}
        for request, prompt in zip(requests, inputs, strict=True):
            for rid, p in request.engine_requests:
                self.engine.add_request(rid, prompt, p, group=request.group)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(by_engine_id) or self.engine.has_unfinished_requests():
            for out in self.engine.step():
                request = by_engine_id[out.request_id]
                delta = request.take(out, self.engine.abort_request)  # a stop string's abort output is ignored
                if delta is not None and delta.finished:
                    finished[out.request_id] = _final(out, request.samples[out.request_id], request.prompt_output)
        return [_grouped([finished[rid] for rid, _ in r.engine_requests]) for r in requests]

    @staticmethod
    def _inputs(prompts: str | Sequence[str] | None,
                prompt_token_ids: Sequence[Sequence[int]] | None) -> list[str | list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(ids) for ids in prompt_token_ids]
        return [prompts] if isinstance(prompts, str) else list(prompts or [])

    @staticmethod
    def _params(sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
                ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
        return list(sampling_params)


def _final(out: RequestOutput, sample: SampleStream, first: RequestOutput | None) -> RequestOutput:
    """The engine's last output of a sample, with the edge's text, tokens and finish (a stop string
    ends a sample before the engine does) and the prompt log-probabilities of the request's first output."""
    return dataclasses.replace(out, token_ids=list(sample.token_ids), finished=True, text=sample.text,
                               finish_reason=sample.finish_reason,
                               logprobs=list(sample.logprobs) if out.logprobs is not None else None,
                               prompt_logprobs=(first or out).prompt_logprobs)


def _grouped(samples: list[RequestOutput]) -> RequestOutput:
    return samples[0] if len(samples) == 1 else dataclasses.replace(samples[0], samples=samples)
