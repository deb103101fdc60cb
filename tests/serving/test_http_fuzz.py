"""Hostile JSON against the OpenAI HTTP API, in the style of the gRPC fuzz test (tests/serving/test_fuzz.py):
hypothesis-generated bodies for /v1/completions, /v1/chat/completions, /tokenize and /detokenize with
every field unset, of its type at its edges (0, negative, 2**31, 2**63, 1e-320, NaN, inf, huge, lone
surrogates, empty) or of another JSON type altogether. Every answer must be below 500, every non-200 an
OpenAI error object whose param (if any) is a field the body has, every stream free of error events;
afterwards the server serves and is idle with every page free. On the real engine on the fake executor,
so the few hundred calls take seconds; accepted requests stay small (max_tokens and n drawn small)."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.conftest import wait_until
from tests.serving.fakes import fake_engine
from tests.serving.raw_http import is_error_object, served

ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                     max_size=3), max_leaves=6)
EDGE_INTS = st.sampled_from([0, -1, 1, 2, 2**31 - 1, 2**31, -2**31 - 1, 2**63, 2**64, 10**30])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-320, 5e-324, 1e-46, 0.5, 1.0, 2.0, -1.0, 1e308, math.inf, -math.inf,
                               math.nan])
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "é" * 30, "Hello"]))
SMALL = st.integers(1, 4)


def field(typed: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: of its own type (edges included) mostly, now and then any JSON at all."""
    return st.one_of(typed, typed, typed, ANY_JSON)


INT = st.one_of(SMALL, EDGE_INTS)
FLOAT = st.one_of(st.floats(-3, 3), EDGE_FLOATS)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 258), EDGE_INTS), max_size=6)
SAMPLING = {
    "max_tokens": field(INT), "n": field(st.one_of(SMALL, EDGE_INTS)), "temperature": field(FLOAT),
    "top_p": field(FLOAT), "top_k": field(INT), "min_p": field(FLOAT), "seed": field(INT),
    "presence_penalty": field(FLOAT), "frequency_penalty": field(FLOAT), "repetition_penalty": field(FLOAT),
    "min_tokens": field(st.one_of(st.integers(0, 3), EDGE_INTS)), "stop_token_ids": field(TOKEN_IDS),
    "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=3))), "ignore_eos": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": field(st.dictionaries(st.text(max_size=3), FLOAT, max_size=2)),
    "model": field(st.sampled_from(["tiny", "gpt-4", "", "\ud800"])), "user": field(TEXT),
}
COMPLETION = {**SAMPLING, "prompt": field(st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3),
                                                    st.lists(TOKEN_IDS, max_size=3))),
              "echo": field(st.booleans()), "logprobs": field(st.one_of(st.integers(0, 3), EDGE_INTS)),
              "prompt_logprobs": field(st.one_of(st.integers(0, 3), EDGE_INTS)), "suffix": field(TEXT),
              "best_of": field(INT)}
MESSAGE = st.fixed_dictionaries({"role": field(st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT)),
                                 "content": field(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": TEXT}), max_size=2)))})
CHAT = {**SAMPLING, "messages": field(st.lists(MESSAGE, max_size=3)), "logprobs": field(st.booleans()),
        "top_logprobs": field(st.one_of(st.integers(0, 3), EDGE_INTS)), "max_completion_tokens": field(INT),
        "add_generation_prompt": field(st.booleans()),
        "chat_template_kwargs": field(st.dictionaries(st.sampled_from(["messages", "bos_token", "x", "range"]),
                                                      ANY_JSON, max_size=2)),
        "tools": field(st.lists(ANY_JSON, max_size=1))}
TOKENIZE = {"prompt": field(TEXT), "messages": field(st.lists(MESSAGE, max_size=2)), "model": SAMPLING["model"]}
DETOKENIZE = {"tokens": field(TOKEN_IDS), "model": SAMPLING["model"]}
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE,
          "/detokenize": DETOKENIZE}
# Params an error may name that the body need not have: a default's field, or what the API calls it.
IMPLIED = {"body", "prompt", "messages", "max_tokens", "max_completion_tokens", "top_logprobs", "model", "tokens"}


@st.composite
def calls(draw: Any) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    fields = ROUTES[route]
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields)))
    return route, {name: draw(fields[name]) for name in chosen}


def call(port: int, route: str, body: dict[str, Any]) -> tuple[int, Any, list[Any]]:
    """(status, JSON body, stream events)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:  # NaN and inf go out as JSON's common extension (NaN, Infinity), as Python's json reads them
        conn.request("POST", route, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    if response.getheader("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return response.status, None, events
    try:
        return response.status, json.loads(raw), []
    except ValueError:  # not JSON (a plain-text 500): `check` says what came
        return response.status, raw, []


def check(route: str, body: dict[str, Any], status: int, answer: Any, events: list[Any]) -> None:
    assert status < 500, (route, body, status, answer)
    if status != 200:
        assert is_error_object(answer, status), (route, body, status, answer)
        param = answer["error"]["param"]
        assert param is None or param.split(".")[0] in set(body) | IMPLIED, (route, body, answer)
    errors = [e for e in events if "error" in e]
    assert not errors, (route, body, errors)


@pytest.fixture(scope="module")
def http_server():
    from jaxcpp.config import ServerConfig
    from jaxcpp.serving.lifecycle import ServerThread

    engine = fake_engine(max_num_seqs=32, num_pages=1025)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0)).start()
    yield server, engine
    server.stop(grace=0)


def test_generated_bodies_get_no_5xx_and_the_server_serves_on(http_server) -> None:
    server, engine = http_server
    counts: Counter[int] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(generated=calls())
    def fuzz(generated: tuple[str, dict[str, Any]]) -> None:
        route, body = generated
        status, answer, events = call(server.http_port, route, body)
        counts[status] += 1
        check(route, body, status, answer, events)

    fuzz()
    print("HTTP fuzz outcomes:", dict(sorted(counts.items())))  # the counts docs/reliability.md quotes
    # both reached: not all refused, not all taken. The bodies hypothesis draws depend on the hypothesis
    # tests run before this one in the process, derandomized or not: 18-22 of 400 were taken (200) alone,
    # after the gRPC fuzz and in the whole suite, so the bar is half that
    assert counts[200] >= 10 and counts[400] >= 100, counts
    assert served(server.http_port)
    wait_until(lambda: engine.stats().num_pages_used == 0 and server.server.num_in_flight == 0)
    assert not engine.has_unfinished_requests()
