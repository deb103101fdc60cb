"""Text that is not Unicode, and template keywords the renderer sets itself (issue 34, item 2): a lone
surrogate anywhere ("\\ud800" escaped, or raw bytes ED A0 80) is a 400 naming where it is, not a
plain-text 500; so is a chat_template_kwargs key that collides. On the real engine on the fake executor."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serving.fakes import fake_engine
from tests.serving.raw_http import CHAT, is_error_object, post, served

LONE = "\ud800"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": "tiny", "prompt": "a" + LONE}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", LONE]}, "prompt.1"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": LONE, "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs.x"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
])
@pytest.mark.parametrize("encoding", ["escaped", "raw bytes"])
def test_lone_surrogates_get_400_naming_the_field(serve, path: str, body: dict, param: str, encoding: str) -> None:
    server = serve(fake_engine())
    data = json.dumps(body).encode()  # "\ud800" escaped, as JSON allows
    if encoding == "raw bytes":  # ED A0 80: what CESU-8 / WTF-8 writers send; Python's json reads it as \ud800
        data = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    status, answer = post(server.http_port, path, data)
    assert status == 400 and is_error_object(answer, 400), (status, answer)  # was: text/plain 500
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(param), answer
    assert served(server.http_port)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "eos_token", "range"])
def test_chat_template_kwargs_the_renderer_sets_get_400(serve, key: str) -> None:
    server = serve(fake_engine())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # was: TypeError, "got multiple values" (500)
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {key: "x"}})
    assert e.value.body["param"] == f"chat_template_kwargs.{key}", e.value.body
    out = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].finish_reason == "length"


