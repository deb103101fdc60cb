"""The OpenAI API's request bodies (pydantic) and what they mean to the engine (host side, no jax).

Field names and defaults are OpenAI's (`/v1/completions`, `/v1/chat/completions`), plus the sampling
extras vLLM accepts (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `prompt_logprobs`), so clients written for either
work unchanged. Structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs`
(`jaxcpp.serving.structured_outputs`); tools: `tools`, `tool_choice`, `parallel_tool_calls`
(`jaxcpp.serving.tool_calls`). Unknown fields are ignored, as vLLM does. The values themselves are
checked once, by `SamplingParams`; an error names the field as the client sent it (`OpenAIError.param`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.structured_outputs import request_constraint


class OpenAIError(Exception):
    """An error the API answers with an OpenAI error object: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "timeout", 413: "request_too_large", 429: "rate_limit_exceeded",
             431: "request_too_large", 500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code or self.status}}

    @staticmethod
    def invalid(error: InvalidRequestError, renames: dict[str, str] | None = None) -> OpenAIError:
        param = (renames or {}).get(error.field, error.field)
        message = str(error)
        if param != error.field:
            message = param + message[len(error.field):]
        return OpenAIError(400, message, param)


def check_text(body: BaseModel) -> None:
    """Every string of the request must be text UTF-8 can carry: JSON's "\\ud800" (and raw bytes ED A0 80,
    which Python's json reads the same way) is a lone surrogate, which no tokenizer or template can
    take. InvalidRequestError naming where it is ("messages.0.content")."""
    path = _lone_surrogate(body.model_dump(exclude_none=True), "")
    if path is not None:
        raise InvalidRequestError(path or "body", "contains a lone UTF-16 surrogate (such as \\ud800), which is "
                                  "not text: send valid Unicode")


def _lone_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        name = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key, name) is not None:
            return name
        found = _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None     # OpenAI's: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the field (SamplingParams checks every value)."""
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "is not supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        optional = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                            "repetition_penalty", "seed")}
        return SamplingParams(
            max_tokens=max_tokens, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, stop=tuple(stop), min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, **{k: v for k, v in optional.items() if v is not None},
            structured_outputs=request_constraint(self.response_format, self.structured_outputs))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[int]


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[Prompt]:
        """One prompt, or a batch: text, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise InvalidRequestError("prompt", "must not be empty")
        return list(p)  # type: ignore[arg-type]

    def check_unsupported(self) -> None:
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of", "is not supported (only best_of = n)")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs of generated tokens, of prompt tokens): echo with logprobs scores the prompt too."""
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else (self.logprobs if self.echo else None)
        return self.logprobs, prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the template as they are

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """Content parts joined into one string, as most chat templates expect."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# Field names SamplingParams uses -> the names each endpoint's clients sent.
COMPLETION_FIELDS = {"prompt_token_ids": "prompt"}
CHAT_FIELDS = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages",
               "max_tokens": "max_completion_tokens"}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
