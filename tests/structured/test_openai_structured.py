"""Structured outputs and tool calls over HTTP, with the official `openai` client against a live server
on the tiny model (byte-level, trained on code: its free text is not JSON): every sampled completion
obeys its response_format / structured_outputs, tool calls carry arguments that parse and match the
function's schema (whole, streamed, parallel), bad constraints are 400s naming the field, the server
keeps serving, and nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from jaxcpp.config import ConfigError, ServerConfig
from jaxcpp.errors import InvalidRequestError
from jaxcpp.serving.chat_template import ChatTemplate
from jaxcpp.serving.client import Client, ClientError
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.lifecycle import ServerThread
from jaxcpp.serving.tool_calls import ToolCalling
from tests.serving.conftest import wait_until

# A Hermes-style template: the tools listed, calls as <tool_call>{...}</tool_call>, tool results. It
# refuses a call whose arguments are not an object (what transformers templates index into).
TEMPLATE = (
    "{%- if tools %}{{ '### tools\\n' }}{%- for t in tools %}{{ t.function.name + '\\n' }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}{{ '### ' + m.role + '\\n' }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{%- if c.function.arguments is not mapping %}{{ raise_exception('arguments must be an object') }}{%- endif %}"
    "{{ '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{%- elif m.role == 'tool' %}{{ '<tool_response>' + m.tool_call_id + ':' + m.content + "
    "'</tool_response>' }}{%- else %}{{ m.content }}{%- endif %}{{ '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '### assistant\\n' }}{%- endif %}")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                  "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["city", "zip"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
               "minItems": 2, "maxItems": 4}},
    "required": ["name", "address", "scores"], "additionalProperties": False}
FLAGS = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}
LEVEL = {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                                          "ok": {"type": "boolean"}}, "required": ["level", "ok"],
         "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(small_llm):
    llm = small_llm(seed=1, max_model_len=512)  # an engine of its own: the server's loop drives it
    config = ServerConfig(port=0, http_port=0, chat_template=TEMPLATE, enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    server = ServerThread(llm.engine, config).start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def idle(server: ServerThread) -> bool:
    """Every page free and nothing left in the engine, once a step still in flight for a finished
    request (async scheduling's one ahead, its token dropped) has come back."""
    engine = server.server.engine_loop.engine  # type: ignore[union-attr]
    wait_until(lambda: engine.allocator.num_used == 0 and not engine.has_unfinished_requests(), timeout=30)
    return True


def compilations(server: ServerThread) -> int:
    return server.server.engine_loop.engine.stats().num_compilations_since_warmup  # type: ignore[union-attr]


@pytest.mark.parametrize("schema", [PERSON, FLAGS, LEVEL], ids=["nested", "array", "enums"])
def test_every_sampled_completion_matches_its_schema(client, server, schema) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=120, temperature=1.0, n=8, seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.finish_reason == "stop"
    assert len({c.message.content for c in out.choices}) > 1  # sampled, not one answer eight times
    assert compilations(server) == 0 and idle(server)


def test_json_object_regex_choice_and_grammar_are_obeyed(client, server) -> None:
    objects = client.chat.completions.create(model="tiny", messages=USER, max_tokens=100, temperature=1.0, n=8,
                                             seed=2, response_format={"type": "json_object"})
    stopped = [c.message.content for c in objects.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(text), dict) for text in stopped)
    assert all(c.message.content.startswith("{") for c in objects.choices)  # cut ones too: a prefix
    extra = {"regex": r"[A-Z]{2}-[0-9]{3}", "choice": ["red", "green", "blue"],
             "grammar": 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nNUM: /[0-9]/\nOP: "+" | "*"'}
    for kind, value in extra.items():
        out = client.completions.create(model="tiny", prompt="x = ", max_tokens=40, temperature=1.0, n=6, seed=4,
                                        extra_body={"structured_outputs": {kind: value}})
        for c in out.choices:
            if kind == "regex":
                assert re.fullmatch(value, c.text), c.text
            elif kind == "choice":
                assert c.text in value
            elif c.finish_reason == "stop":
                assert re.fullmatch(r"[0-9]|\(.*\)", c.text) and c.text.count("(") == c.text.count(")"), c.text
    text = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0,
                                          response_format={"type": "text"})
    free = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0)
    assert text.choices[0].message.content == free.choices[0].message.content  # "text": free, as before
    assert compilations(server) == 0 and idle(server)


def test_required_and_named_tool_calls_carry_valid_arguments(client, server) -> None:
    schema = WEATHER["function"]["parameters"]
    required = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], n=6, seed=5,
                                              tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                              max_tokens=120)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        called = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(arguments, called["function"]["parameters"])
    named = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], n=4, seed=6,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=1.0, max_tokens=80)
    for choice in named.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "stop"  # OpenAI's, for a named one
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert compilations(server) == 0 and idle(server)


def assembled(stream) -> tuple[str, list[dict], str | None]:
    """A streamed chat choice 0 put together the way clients do: content joined, calls by index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_are_assembled_by_the_client(client, server) -> None:
    kwargs = dict(model="tiny", messages=USER, tools=[WEATHER, TIME], temperature=0.0, max_tokens=80,
                  parallel_tool_calls=False)  # greedy, the tiny model would call get_time past max_tokens
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        whole = client.chat.completions.create(tool_choice=choice, **kwargs).choices[0]
        _, calls, finish = assembled(client.chat.completions.create(tool_choice=choice, stream=True, **kwargs))
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert finish == whole.finish_reason and all(c["id"].startswith("call_") for c in calls)
        json.loads(calls[0]["arguments"])
    assert idle(server)


def test_auto_parses_hermes_calls_and_parallel_ones(client, server) -> None:
    """The tiny model never writes a call by itself: a regex makes it write two, which "auto" parses."""
    two = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "(Paris|Oslo)", "days": [1-7]}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {"zone": "(UTC|CET)"}}</tool_call>')
    regex = two.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")
    kwargs = dict(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice="auto", temperature=1.0,
                  max_tokens=250, extra_body={"structured_outputs": {"regex": regex}})
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    names = [c.function.name for c in out.message.tool_calls]
    assert names == ["get_weather", "get_time"] and len({c.id for c in out.message.tool_calls}) == 2
    jsonschema.validate(json.loads(out.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish = assembled(client.chat.completions.create(stream=True, seed=1, **kwargs))
    assert content == "Sure." and [c["name"] for c in calls] == names and finish == "tool_calls"
    single = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert [c.function.name for c in single.message.tool_calls] == ["get_weather"]
    plain = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=8, temperature=0.0).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"  # no call written: content
    assert idle(server)


def test_tools_and_tool_messages_reach_the_template(client, server) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4, temperature=0.0)
    rendered = ChatTemplate(TEMPLATE, {}).render(
        [*USER, {"role": "assistant", "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {
            "city": "Oslo", "days": 2}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
        True, {"tools": [WEATHER]})
    assert "### tools\nget_weather" in rendered and "<tool_response>call_1:rain" in rendered
    assert out.usage.prompt_tokens == len(rendered.encode())  # exactly that text (byte tokens)
    assert out.choices[0].message.tool_calls is None  # "none": content only


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: missing_rule"}}), "structured_outputs.grammar"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
])
def test_bad_constraints_and_tools_are_400s_naming_the_field(client, server, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body
    assert idle(server)  # refused before any page was taken
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices  # still serving


def test_grpc_takes_the_same_constraints(server) -> None:
    constraints = [(pb.StructuredOutputs(json=json.dumps(LEVEL)), lambda t: jsonschema.validate(json.loads(t), LEVEL)),
                   (pb.StructuredOutputs(choice=pb.Choices(values=["up", "down"])), lambda t: t in ("up", "down")),
                   (pb.StructuredOutputs(regex="[0-9]{4}"), lambda t: re.fullmatch("[0-9]{4}", t))]
    with Client(f"127.0.0.1:{server.port}", timeout=120) as grpc_client:
        for so, check in constraints:
            for seed in range(3):
                out = grpc_client.generate("x = ", max_tokens=60, temperature=1.0, seed=seed, structured_outputs=so)
                assert check(out.text) is not False, out.text
        with pytest.raises(ClientError) as e:
            grpc_client.generate("x", max_tokens=4, structured_outputs=pb.StructuredOutputs(grammar="start: nope"))
        assert e.value.status == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "structured_outputs.grammar"
    assert idle(server)


def test_auto_needs_the_flags() -> None:
    """OpenAI's default tool_choice is "auto": a server without vLLM's two flags says which it needs."""
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice and --tool-call-parser") as e:
        ToolCalling.of([WEATHER], None, None, auto_enabled=False, parser=None)
    assert e.value.field == "tool_choice"
    assert ToolCalling.of([WEATHER], "none", None, auto_enabled=False, parser=None).constraint is None
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice: needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="--tool-call-parser: must be hermes"):
        ServerConfig(tool_call_parser="mistral")
