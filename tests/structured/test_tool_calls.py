"""The Hermes parser and the streamed tool-call deltas, host only: what the server sends for a text."""

from __future__ import annotations

import json

from jaxcpp.serving.tool_calls import ToolCalling, ToolStream, merge, parse_hermes, template_messages

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]
TEXT = 'Let me see. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g"}</tool_call>'


def test_hermes_calls_are_parsed_and_the_rest_is_content() -> None:
    content, calls = parse_hermes(TEXT)
    assert content == "Let me see." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1} and calls[1]["function"]["arguments"] == "{}"
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes(TEXT, parallel=False)[1][0]["function"]["name"] == "f"
    broken = 'x <tool_call>{"name": "f", "argu</tool_call>'
    assert parse_hermes(broken) == (broken, [])  # a call that does not parse stays text


def test_auto_streams_content_and_holds_back_what_may_open_a_call() -> None:
    stream = ToolStream(ToolCalling(TOOLS, "auto", parser="hermes"))
    pieces = [TEXT[i:i + 5] for i in range(0, len(TEXT), 5)]
    sent = [merge(stream.feed(p, i == len(pieces) - 1)) for i, p in enumerate(pieces)]
    content = "".join(d.get("content", "") for d in sent)
    calls = [c for d in sent for c in d.get("tool_calls", [])]
    assert content.strip() == "Let me see." and "<tool" not in content
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f"), (1, "g")]
    assert stream.made_calls


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    stream = ToolStream(ToolCalling(TOOLS, "f"))
    first, second = merge(stream.feed('{"a"', False)), merge(stream.feed(": 1}", True))
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first["tool_calls"][1]["function"] == {"arguments": '{"a"'}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}


def test_template_messages_get_arguments_as_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    (message,) = template_messages([{"role": "assistant", "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert call["function"]["arguments"] == '{"a": 1}'  # the request's own message is left as it came
