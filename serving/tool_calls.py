"""Tool calling in /v1/chat/completions (host side, no jax): the request's tools, what its tool_choice
asks of the output, and the output turned back into `tool_calls`, whole or streamed.

    tool_choice  "none"      the template sees the tools; the output is plain content
                 "auto"      the model decides; calls are parsed from its text by --tool-call-parser
                             (hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>), which
                             needs --enable-auto-tool-choice (vLLM's flags; a 400 says so otherwise)
                 "required"  the output is constrained to a JSON array of calls, each {"name": one of the
                             tools, "parameters": that tool's parameter schema} (one call unless
                             parallel_tool_calls), so the arguments always parse
                 {"type": "function", "function": {"name": N}}   the output is constrained to N's
                             parameter schema: it is the call's arguments (finish_reason "stop", as OpenAI)

The chat template receives `tools` as transformers passes them (the request's list of {"type":
"function", "function": {...}}), and the conversation's assistant `tool_calls` with their arguments as
objects (templates index them), `tool` messages as they came. Each call gets an id "call_<24 hex>".
Streaming: a named call streams its arguments as they are generated; "required" and "auto" calls go out
whole once complete (content before an auto call streams as content), as deltas the official client
assembles by `index`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from jaxcpp.errors import InvalidRequestError
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.structured.constraint import StructuredOutputs

PARSERS = ("hermes",)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"
Event = dict[str, Any]


@dataclass(frozen=True)
class ToolCalling:
    tools: list[dict[str, Any]]
    choice: str                   # "none", "auto", "required", or a function's name
    parallel: bool = True
    parser: str | None = None     # --tool-call-parser, for "auto"

    @staticmethod
    def of(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
           auto_enabled: bool, parser: str | None) -> ToolCalling | None:
        """The request's tool calling, checked (InvalidRequestError naming the field), or None."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice", "needs tools")
            return None
        names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
        choice = _choice(tool_choice, names)
        if choice == "auto" and not (auto_enabled and parser):
            raise InvalidRequestError("tool_choice", '"auto" needs the server started with '
                                      "--enable-auto-tool-choice and --tool-call-parser")
        calling = ToolCalling(tools, choice, parallel is not False, parser)
        _ = calling.constraint  # a parameter schema the grammar library cannot compile: a 400 now
        return calling

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def makes_calls(self) -> bool:
        return self.choice != "none"

    @property
    def named(self) -> str | None:
        return self.choice if self.choice not in ("none", "auto", "required") else None

    @cached_property
    def constraint(self) -> StructuredOutputs | None:
        """What "required" and a named choice constrain the output to (None: free text)."""
        if self.named is not None:
            index = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.named)
            return StructuredOutputs.from_schema(_parameters(self.tools[index]["function"]),
                                                 f"tools[{index}].function.parameters")
        if self.choice != "required":
            return None
        for index, tool in enumerate(self.tools):  # each schema's own error first, naming its tool
            StructuredOutputs.from_schema(_parameters(tool["function"]), f"tools[{index}].function.parameters")
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(fn)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, fn in self.functions.items()]
        one = {} if self.parallel else {"maxItems": 1}
        return StructuredOutputs.from_schema({"type": "array", "items": {"anyOf": calls}, "minItems": 1, **one},
                                             "tools")

    def parse(self, text: str) -> tuple[str | None, list[Event]]:
        """A finished sample's text -> (content, tool calls)."""
        if self.named is not None:
            return None, [_call(self.named, text)]
        if self.choice == "required":
            try:
                return None, [_call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return text, []  # cut short (max_tokens): left as text
        if self.choice == "auto":
            return parse_hermes(text, self.parallel)
        return text, []

    def message(self, text: str) -> Event:
        content, calls = self.parse(text)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the constraint "required" or a named choice puts on the output."""
        if self.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError("response_format", "cannot be combined with tool_choice \"required\" or a "
                                      "named function (the call's arguments are constrained already)")
        return replace(params, structured_outputs=self.constraint)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """"tool_calls" where the model called tools ("required", "auto"); a named call ends with "stop"."""
        return "tool_calls" if made_calls and reason == "stop" and self.named is None else reason


def parse_hermes(text: str, parallel: bool = True) -> tuple[str | None, list[Event]]:
    """Hermes-style calls out of `text`: each <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    whose JSON parses becomes a call; the rest of the text is the content (None if empty)."""
    calls: list[Event] = []
    for match in HERMES_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
            calls.append(_call(str(body["name"]), json.dumps(body.get("arguments", {}))))
        except (ValueError, TypeError, KeyError):
            continue
    if not calls:
        return text, []
    content = HERMES_CALL.sub("", text).strip()
    return content or None, calls if parallel else calls[:1]


@dataclass
class ToolStream:
    """One streamed sample's tool calls: its text deltas in, chat `delta` objects out."""

    calling: ToolCalling
    text: str = ""
    sent: int = 0                 # characters of `text` already sent as content (auto)
    started: bool = False         # a named call's header went out
    calls: list[Event] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> list[Event]:
        """The deltas to send for `delta` (more text of the sample); with `finished`, the rest."""
        self.text += delta
        c = self.calling
        if c.named is not None:
            out = [] if self.started else [{"tool_calls": [{"index": 0, **_call(c.named, "")}]}]
            self.started = True
            return out + ([{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else [])
        if c.choice == "auto":
            return self._auto(finished)
        if finished:  # required: the whole array, once complete
            return self._whole(*c.parse(self.text))
        return []

    def _auto(self, finished: bool) -> list[Event]:
        if finished:
            content, calls = parse_hermes(self.text[self.sent:], self.calling.parallel)
            return self._whole(content, calls)
        opened = self.text.find(HERMES_OPEN, self.sent)
        safe = opened if opened >= 0 else _without_open_prefix(self.text)  # hold back a "<tool_c" at the end
        out = [{"content": self.text[self.sent:safe]}] if safe > self.sent else []
        self.sent = max(self.sent, safe)
        return out

    def _whole(self, content: str | None, calls: list[Event]) -> list[Event]:
        self.calls = calls
        out: list[Event] = [{"content": content}] if content else []
        return out + [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]

    @property
    def made_calls(self) -> bool:
        return bool(self.calls) or self.started


def merge(deltas: list[Event]) -> Event:
    """Several deltas as one chunk's: contents joined, tool call entries in order."""
    merged: Event = {}
    for d in deltas:
        if d.get("content"):
            merged["content"] = merged.get("content", "") + d["content"]
        if d.get("tool_calls"):
            merged["tool_calls"] = merged.get("tool_calls", []) + d["tool_calls"]
    return merged


def template_messages(messages: list[Event]) -> list[Event]:
    """The conversation as chat templates read it: an assistant's tool call arguments as objects."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_arguments_as_object(c) for c in calls]}
        out.append(message)
    return out


def _arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _without_open_prefix(text: str) -> int:
    """len(text), less a tail that could be the start of "<tool_call>"."""
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call(name: str, arguments: str) -> Event:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parameters(function: dict[str, Any]) -> Any:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _check_tool(index: int, tool: Any) -> str:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"{where}.function.name", "must be a non-empty string")
    if not isinstance(function.get("parameters", {}), dict):
        raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON schema object")
    return function["name"]


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"  # OpenAI's default when tools are given
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}')
    if name not in names:
        raise InvalidRequestError("tool_choice", f"names function {name!r}, which is not among the tools "
                                  f"({', '.join(names)})")
    return name
