"""The OpenAI API on real engines, with the official client on loopback: the tiny model (logprobs against
the engine's own logits, 64 concurrent streams against offline greedy output, a disconnect freeing every
page, chat out of the box), and a random Hugging Face Llama saved with transformers (prompt logprobs of
`echo`, and the repetition penalty and min_tokens, against transformers on the same checkpoint)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import numpy as np
import openai
import pytest

from jaxcpp import LLM, SamplingParams
from jaxcpp.config import ServerConfig
from jaxcpp.serving.lifecycle import ServerThread
from tests.serving.conftest import offline, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [f"def f{i}(x):\n    return" for i in range(64)]


def client_for(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0, timeout=300)


def token_id(text: str) -> int:
    """The byte tokenizer's token back from its text in the API (`token_id:N` for one that is no text)."""
    return int(text.split(":")[1]) if text.startswith("token_id:") else text.encode()[0]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_and_top_5_are_the_log_softmax_of_the_engines_own_logits(tiny_llm: Any, real_server) -> None:
    prompt = "import numpy as np\n"
    tiny_llm.engine.record_logits = True
    try:
        greedy = offline(real_server, tiny_llm, [prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    finally:
        tiny_llm.engine.record_logits = False
    out = client_for(real_server).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                     logprobs=5)
    lp = out.choices[0].logprobs
    assert [token_id(t) for t in lp.tokens] == greedy.token_ids
    for logits, token, logprob, top in zip(greedy.logits, greedy.token_ids, lp.token_logprobs, lp.top_logprobs,
                                           strict=True):
        exact = log_softmax(np.asarray(logits))
        assert abs(logprob - exact[token]) < 1e-4
        best = np.argsort(-exact)[:5]
        ours = {token_id(t): v for t, v in top.items()}
        assert set(best) <= set(ours)  # the top 5, and the sampled token (vLLM's shape)
        for t in best:
            assert abs(ours[int(t)] - exact[t]) < 1e-4


def test_64_concurrent_streams_are_exactly_the_offline_greedy_output(tiny_llm: Any, real_server, real_client) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = [(o.text, o.finish_reason) for o in offline(real_server, tiny_llm, PROMPTS, params)]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{real_server.http_port}/v1", api_key="x",
                                max_retries=0, timeout=600)

    async def one(prompt: str) -> tuple[str, str | None]:
        text, finish = "", None
        async for chunk in await client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them() -> list[tuple[str, str | None]]:
        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        finally:
            await client.close()

    assert asyncio.run(all_of_them()) == expected
    wait_until(lambda: real_client.stats().engine.num_pages_used == 0 and real_client.stats().num_in_flight == 0)


def test_a_disconnect_mid_stream_leaves_every_page_free(real_server, real_client) -> None:
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 400, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{real_server.http_port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.readline()
        assert real_client.stats().engine.num_pages_used > 0
    wait_until(lambda: real_client.stats().engine.num_pages_used == 0 and real_client.stats().num_in_flight == 0,
               timeout=30)


def test_chat_works_out_of_the_box_on_the_bundled_model(real_server) -> None:
    out = client_for(real_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "write a loop"}], max_tokens=12, temperature=0,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "presence_penalty": 0.5, "min_tokens": 4})
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 4


# ---- against transformers on one checkpoint ------------------------------------------------------------
HF_DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
IDS = [5, 17, 99, 3, 42, 42, 8, 61, 23, 77, 5, 19, 100, 64, 1, 30, 30, 9]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Skipped without torch and transformers (the parity extra); the tests above need neither."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **HF_DIMS), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms off 1, weights large enough for spread-out logits
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf_llama")
    model.eval().save_pretrained(folder)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
              log_stats_interval_s=0)
    with ServerThread(llm.engine, ServerConfig(port=0, http_port=0)) as server:
        yield model, server


@pytest.mark.parity
def test_echo_prompt_logprobs_equal_transformers(hf_checkpoint: Any) -> None:
    model, server = hf_checkpoint
    import torch
    client = client_for(server)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=IDS, max_tokens=1, temperature=0,
                                    echo=True, logprobs=5)
    lp = out.choices[0].logprobs
    with torch.no_grad():
        exact = torch.log_softmax(model(torch.tensor([IDS])).logits[0].double(), -1).numpy()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has none
    assert [token_id(t) for t in lp.tokens[:len(IDS)]] == IDS
    for i in range(1, len(IDS)):
        assert abs(lp.token_logprobs[i] - exact[i - 1, IDS[i]]) < 1e-4
        best = np.argsort(-exact[i - 1])[:5]
        ours = {token_id(t): v for t, v in lp.top_logprobs[i].items()}
        assert all(abs(ours[int(t)] - exact[i - 1, t]) < 1e-4 for t in best)
    # the generated token's logprob continues the same way
    assert abs(lp.token_logprobs[len(IDS)] - exact[-1].max()) < 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("penalty", [1.0, 1.6, 0.7])
def test_repetition_penalty_and_min_tokens_give_transformers_greedy_tokens(hf_checkpoint: Any, penalty: float) -> None:
    model, server = hf_checkpoint
    import torch
    client = client_for(server)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=IDS, max_tokens=24, temperature=0,
                                    logprobs=0, extra_body={"repetition_penalty": penalty, "min_tokens": 24})
    ours = [token_id(t) for t in out.choices[0].logprobs.tokens]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([IDS]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                repetition_penalty=penalty, pad_token_id=0)[0, len(IDS):].tolist()
    assert ours == theirs
