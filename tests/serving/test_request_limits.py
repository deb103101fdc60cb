"""One request must not take the server down (issue 34, item 1): values past the device's int32 /
float32 arrays, replayed through the official openai client and gRPC, get a 400 / INVALID_ARGUMENT
naming the field, and the next normal request is served. On the real engine on the fake executor."""

from __future__ import annotations

import grpc
import openai
import pytest

from jaxcpp.serving.client import Client, build_request
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from tests.serving.fakes import expected_tokens, fake_engine

PROMPT = "Hello"


def expected_text(n: int) -> str:
    return bytes(expected_tokens(list(PROMPT.encode()), n)).decode()


@pytest.mark.parametrize(("body", "param"), [
    ({"top_k": 2**31}, "top_k"),                                  # was: OverflowError in the step, exit 1
    ({"min_tokens": 1, "stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"top_p": 1e-320}, "top_p"),                                 # was: 0 in float32, every token token 0
    ({"repetition_penalty": 1e-320}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"n": 2**31}, "n"),
    ({"logprobs": 2**31}, "logprobs"),
])
def test_http_values_past_the_device_arrays_get_400_and_the_server_serves_on(serve, body, param) -> None:
    server = serve(fake_engine())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                           timeout=30)
    top_level = {k: body.pop(k) for k in ("top_p", "seed", "n", "logprobs") if k in body}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body=body, **top_level)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param), e.value.body
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == expected_text(4)
    if param != "logprobs":  # the chat API's logprobs is a boolean
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=2, extra_body=body, **top_level)
        assert e.value.body["param"] == param, e.value.body
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("sampling", "field"), [
    ({"top_p": 1e-320}, "top_p"), ({"repetition_penalty": 1e-320}, "repetition_penalty"),
])
def test_grpc_values_past_the_device_arrays_get_invalid_argument(serve, fake_client: Client, sampling,
                                                                 field) -> None:
    # top_k and stop_token_ids are int32 in the proto: 2**31 cannot be sent (the stub refuses it).
    request = build_request(PROMPT, max_tokens=4)
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.JaxcppServiceStub(fake_client.channel).Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), \
        e.value.details()
    assert fake_client.generate(PROMPT, max_tokens=4, temperature=0).token_ids == expected_tokens(list(b"Hello"), 4)
    with pytest.raises(ValueError):
        fake_client.generate(PROMPT, max_tokens=4, top_k=2**31)
