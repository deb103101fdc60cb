"""The one admission path of both front ends (serving/admission.py): tokenization in one place, on one
thread; the prompt-size refusal worded once; the output loop's step
(`RequestState.take`) shared with `LLM`; one API-key check for both ports (serving/security.py).
Around the real engine on the fake executor (no jax). The one registry of calls in flight, and the queue
limit over both front ends, is test_openai_api.py's `test_grpc_and_http_share_one_engine_and_one_queue`."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from jaxcpp.core.outputs import RequestMetrics, RequestOutput
from jaxcpp.output_processor import RequestState
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.client import Client
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.lifecycle import ServerThread
from jaxcpp.tokenizer import ByteTokenizer
from tests.serving.fakes import fake_engine


class _RecordingTokenizer(ByteTokenizer):
    """The byte tokenizer, noting the thread of every encode."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text)


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_both_front_ends_tokenize_on_the_asyncio_loop_never_on_the_engine_thread(
        serve: Callable[..., ServerThread]) -> None:
    engine = fake_engine()
    tokenizer = engine.tokenizer = _RecordingTokenizer()
    server = serve(engine)
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        assert client.generate("abc", max_tokens=2).token_ids
    status, body = _post(f"http://127.0.0.1:{server.http_port}/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200, body
    assert tokenizer.threads and set(tokenizer.threads) == {"jaxcpp-grpc"}, tokenizer.threads


def test_a_prompt_over_max_prompt_bytes_is_refused_in_the_same_words_by_both(
        serve: Callable[..., ServerThread]) -> None:
    server = serve(fake_engine(), max_prompt_bytes=16)
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client, pytest.raises(grpc.RpcError) as e:
        client.generate("x" * 17, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, body = _post(f"http://127.0.0.1:{server.http_port}/v1/completions", {"prompt": "x" * 17})
    assert status == 413 and body["error"]["param"] == "prompt"
    words = "prompt text is over --max-prompt-bytes 16 (UTF-8 bytes)"
    assert e.value.details() == f"text: {words}" and body["error"]["message"] == f"prompt: {words}"


def test_take_aborts_a_sample_a_stop_string_ended_while_the_engine_runs_it() -> None:
    state = RequestState("r", SamplingParams(max_tokens=8, stop=("b",)), ByteTokenizer())
    aborted: list[tuple[str, str]] = []
    out = RequestOutput("r", [97], [], [97, 98], False, None, RequestMetrics(0.0))
    delta = state.take(out, lambda rid, reason: aborted.append((rid, reason)))
    assert delta is not None and delta.finished and delta.text == "a" and aborted == [("r", "stop")]


def test_the_grpc_port_reads_the_api_key_as_the_http_port_does_the_scheme_in_any_case(
        serve: Callable[..., ServerThread]) -> None:
    server = serve(fake_engine(), api_key="k3y")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.JaxcppServiceStub(channel)
        for value in ("bearer k3y", "BEARER k3y", "Bearer  k3y"):
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", value),), timeout=10).name
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer k3"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status, _ = _post(f"http://127.0.0.1:{server.http_port}/v1/completions", {"prompt": "a"})
    assert status == 401
