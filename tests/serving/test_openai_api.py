"""The OpenAI-compatible HTTP API with the official `openai` client, against a live server on loopback
around the real engine on the fake executor (deterministic tokens, no jax): completions and chat,
blocking and streaming, n with indexes, stop strings, usage, the endpoints beside them, and the error
objects clients handle (400 naming the field, 401, 404, 413, 429, 503). Every test ends with the
engine idle: no page used, no call held."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from jaxcpp.config import ServerConfig
from jaxcpp.serving.lifecycle import ServerThread
from tests.serving.conftest import wait_until
from tests.serving.fakes import expected_tokens, fake_engine

PROMPT = "def quicksort(items):"


def post(url: str, body: dict[str, Any], timeout: float = 30) -> Any:
    """A raw JSON POST (urllib): the response, open, for the test to read or drop."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def status(url: str) -> int:
    try:
        return int(urllib.request.urlopen(url).status)
    except urllib.error.HTTPError as e:
        return e.code


def expected_text(prompt: str, n: int) -> str:
    return bytes(expected_tokens(list(prompt.encode()), n)).decode()


@pytest.fixture
def http(serve: Callable[..., ServerThread]) -> Callable[..., tuple[openai.OpenAI, ServerThread]]:
    def start(engine: Any = None, api_key: str = "none", **config: Any) -> tuple[openai.OpenAI, ServerThread]:
        server = serve(fake_engine() if engine is None else engine, **config)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=api_key, max_retries=0,
                               timeout=30)
        return client, server

    return start


def idle(server: ServerThread) -> bool:
    engine = server.server.engine_loop.engine  # type: ignore[union-attr]
    return engine.allocator.num_used == 0 and server.server.num_in_flight == 0 and \
        not engine.has_unfinished_requests()


def test_completions_blocking_and_streaming(http) -> None:
    client, server = http()
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny" and out.created
    assert out.choices[0].text == expected_text(PROMPT, 12) and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (21, 12, 33)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(PROMPT, 12)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1
    wait_until(lambda: idle(server))


def test_a_batch_of_prompts_as_text_and_token_ids(http) -> None:
    client, _ = http()
    ids = list(b"abc")
    out = client.completions.create(model="tiny", prompt=[ids, list(b"xyz")], max_tokens=4, n=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [p + expected_text(p, 4) for p in ("abc", "xyz")]
    assert [c.text for c in out.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 16


def test_chat_blocking_and_streaming_with_the_bundled_template(http) -> None:
    client, server = http()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = "### system\nbe brief\n### user\nhi\n### assistant\n"
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(prompt, 6)
    assert out.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(prompt, 6)
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_until(lambda: idle(server))


def test_n_3_streaming_carries_each_samples_index(http) -> None:
    client, server = http()
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3, stream=True))
    texts: dict[int, str] = {}
    finished = set()
    for c in chunks:
        choice = c.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert texts == {i: expected_text(PROMPT, 5) for i in range(3)} and finished == {0, 1, 2}
    wait_until(lambda: idle(server))


def test_a_stop_string_spanning_two_tokens_ends_the_text_and_frees_the_request(http) -> None:
    client, server = http()
    full = expected_text(PROMPT, 30)
    stop = full[8:10]  # two tokens of the byte-level model
    cut = full.index(stop)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=[stop])
    assert out.choices[0].text == full[:cut] and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    wait_until(lambda: idle(server))


def test_logprobs_of_completions_and_chat_have_their_shapes(http) -> None:
    client, _ = http()
    out = client.completions.create(model="tiny", prompt="ab", max_tokens=3, logprobs=2, echo=True)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["a", "b", *expected_text("ab", 3)] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [0, 1, 2, 3, 4]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=50), "logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(extra_body={"min_p": 2.0}), "min_p"), (dict(extra_body={"repetition_penalty": -1.0}), "repetition_penalty"),
    (dict(max_tokens=600), "max_tokens"), (dict(extra_body={"top_k": "x"}), "top_k"), (dict(suffix="x"), "suffix"),
])
def test_400_names_the_field(http, kwargs: dict, param: str) -> None:
    client, server = http()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param) and e.value.body["type"] == "invalid_request_error"
    assert idle(server)


def test_chat_errors_name_the_chat_fields(http) -> None:
    client, _ = http()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=25)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_a_model_without_a_chat_template_gets_a_400_saying_how_to_give_one(http, tmp_path) -> None:
    from jaxcpp.serving.chat_template import ChatTemplate, load_chat_template

    assert load_chat_template(tmp_path, None) is None
    client, server = http()
    server.server.http._chat_template = None  # type: ignore[union-attr]  # as a folder without one
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert "--chat-template" in e.value.body["message"]
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[-1]['content'] }}!")
    assert load_chat_template(tmp_path, str(file)).render([{"role": "user", "content": "x"}]) == "x!"
    with pytest.raises(Exception, match="refused"):  # the sandbox: no reaching Python internals
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {}).render([])


def test_404_unknown_model_and_413_prompt_too_large(http) -> None:
    client, server = http(max_prompt_bytes=64)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="y" * 65, max_tokens=1)
    assert e.value.status_code == 413 and "--max-prompt-bytes" in e.value.body["message"]
    assert idle(server)


def test_401_without_the_api_key(serve) -> None:
    server = serve(fake_engine(), api_key="secret")
    url = f"http://127.0.0.1:{server.http_port}/v1"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert status(url + "/models") == 401  # no key at all
    ok = openai.OpenAI(base_url=url, api_key="secret", max_retries=0)
    assert [m.id for m in ok.models.list()] == ["tiny"]
    listed = urllib.request.urlopen(urllib.request.Request(url + "/models", headers={"Authorization": "Bearer secret"}))
    assert json.loads(listed.read())["data"][0]["kv_cache_dtype"] == "float32"  # what the KV pages hold
    assert urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health").status == 200  # probes: no key


def test_429_when_the_queue_is_full(http) -> None:
    client, server = http(fake_engine(step_delay_s=0.01), max_queue_size=1)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=300, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert e.value.status_code == 429 and "--max-queue-size 1" in e.value.body["message"]
    stream.close()
    wait_until(lambda: idle(server))


def test_503_while_warming_up_and_draining() -> None:
    server = ServerThread(None, ServerConfig(port=0, http_port=0)).start()
    base = f"http://127.0.0.1:{server.http_port}"
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and "warming up" in e.value.body["message"]
        assert status(base + "/health") == 503
        server.build_engine(fake_engine).result(timeout=60)
        assert status(base + "/health") == 200
        server.server.http.close()  # type: ignore[union-attr]  # what SIGTERM does first
        assert status(base + "/health") == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and "shutting down" in e.value.body["message"]
    finally:
        server.stop()


def test_a_client_that_disconnects_mid_stream_aborts_its_request(http) -> None:
    client, server = http(fake_engine(step_delay_s=0.01))
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    with post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True}) as r:
        assert r.readline().startswith(b"data: ")
        assert server.server.engine_loop.engine.allocator.num_used > 0  # type: ignore[union-attr]
    wait_until(lambda: idle(server), timeout=5)
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):  # a blocking call cut off
        post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 400}, timeout=0.3)
    wait_until(lambda: idle(server), timeout=5)


def test_the_listening_socket_says_tcp_so_streams_are_not_held_by_nagle(http) -> None:
    _, server = http()
    sockets = [s for srv in server.server.http._server.servers for s in srv.sockets]  # type: ignore[union-attr]
    assert sockets and all(s.proto == socket.IPPROTO_TCP for s in sockets)  # asyncio sets TCP_NODELAY then


def test_tokenize_detokenize_version_metrics_and_the_remote_tokenizer(http) -> None:
    _, server = http()
    base = f"http://127.0.0.1:{server.http_port}"
    tokens = json.load(post(base + "/tokenize", {"prompt": "héllo"}))
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6 and tokens["max_model_len"] == 512
    assert json.load(post(base + "/detokenize", {"tokens": tokens["tokens"]})) == {"prompt": "héllo"}
    chat = json.load(post(base + "/tokenize", {"messages": [{"role": "user", "content": "a"}]}))
    assert bytes(chat["tokens"]).decode() == "### user\na\n### assistant\n"
    info = json.load(urllib.request.urlopen(base + "/tokenizer_info"))  # lm-evaluation-harness's remote tokenizer
    assert "eos_token" in info and info["chat_template"].startswith("{%")
    assert json.load(urllib.request.urlopen(base + "/version"))["version"]
    openai.OpenAI(base_url=base + "/v1", api_key="x").completions.create(model="tiny", prompt="a", max_tokens=2)
    assert b"jaxcpp_time_to_first_token_seconds_count" in urllib.request.urlopen(base + "/metrics").read()


def test_grpc_and_http_share_one_engine_and_one_queue(http) -> None:
    from jaxcpp.serving.client import Client

    client, server = http(fake_engine(step_delay_s=0.01), max_queue_size=1)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=300, stream=True)
    next(iter(stream))
    with Client(f"127.0.0.1:{server.port}", timeout=10) as grpc_client:
        assert grpc_client.stats().num_in_flight == 1
        with pytest.raises(Exception, match="queue is full"):
            grpc_client.generate("x", max_tokens=1)
    stream.close()
    wait_until(lambda: idle(server))


def _sse_events(lines: Iterator[str]) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in lines if line]


def test_the_stream_is_server_sent_events_ending_with_done(http) -> None:
    _, server = http()
    with post(f"http://127.0.0.1:{server.http_port}/v1/chat/completions",
              {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(line.decode().rstrip("\n") for line in r)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_concurrent_streams_from_threads(http) -> None:
    client, server = http()
    results: dict[int, str] = {}

    def run(i: int) -> None:
        prompt = f"{PROMPT} {i}"
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, stream=True)
        results[i] = "".join(c.choices[0].text for c in stream)
        assert results[i] == expected_text(prompt, 8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16
    wait_until(lambda: idle(server))


def test_past_the_grace_period_an_http_stream_ends_with_finish_reason_abort(serve) -> None:
    engine = fake_engine(step_delay_s=0.01)
    server = serve(engine)
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    with post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True}) as r:
        assert r.readline().startswith(b"data: ")
        server.stop(grace=0.2)  # what SIGTERM runs: drain, then abort what is left
        events = _sse_events(line.decode().rstrip("\n") for line in r)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    stats = engine.stats()
    assert (stats.num_pages_used, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_tls_and_mutual_tls_on_the_http_port(serve, tmp_path) -> None:
    import shutil
    import ssl

    from tests.serving.test_security import _ca_and_leaf

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    server_ca, server_cert, server_key = _ca_and_leaf(tmp_path, "server", "localhost")
    client_ca, client_cert, client_key = _ca_and_leaf(tmp_path, "client", "alice")
    server = serve(fake_engine(), tls_cert=str(server_cert), tls_key=str(server_key), tls_client_ca=str(client_ca))
    url = f"https://127.0.0.1:{server.http_port}/v1/models"
    context = ssl.create_default_context(cafile=str(server_ca))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):  # no client certificate
        urllib.request.urlopen(url, context=context, timeout=10).read()
    context.load_cert_chain(str(client_cert), str(client_key))
    assert json.load(urllib.request.urlopen(url, context=context, timeout=10))["data"][0]["id"] == "tiny"
