"""The server around the real engine on the bundled tiny model, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving import AsyncClient, Client
from tests.serving.conftest import MAX_MESSAGE_BYTES, REAL_ENGINE_KWARGS, offline, started_stream

pytestmark = pytest.mark.slow

PROMPTS = ["def quicksort(", "Once upon a time", "import numpy as np\n", "class Foo:\n    def __init__(self"]


def wait_idle(client: Client, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats.engine.num_pages_used == 0 and stats.num_in_flight == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_streaming_gives_exactly_the_offline_greedy_tokens(real_server, real_client, tiny_llm) -> None:
    expected = offline(real_server, tiny_llm, PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        deltas = list(real_client.stream(prompt, max_tokens=24, temperature=0))
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text
        assert (deltas[-1].finish_reason, deltas[-1].num_prompt_tokens) == (ref.finish_reason,
                                                                             len(ref.prompt_token_ids))
        assert deltas[-1].ttft_s > 0


def test_32_concurrent_streams_all_complete(real_server, real_client, tiny_llm) -> None:
    prompts = [f"# example {i}\ndef f{i}(x):" for i in range(32)]
    expected = offline(real_server, tiny_llm, prompts, SamplingParams(max_tokens=16, temperature=0))

    async def main() -> list:
        async with AsyncClient(f"127.0.0.1:{real_server.port}", timeout=300) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=16, temperature=0) for p in prompts))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [r.token_ids for r in expected]
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert wait_idle(real_client).engine.num_pages_used == 0


def test_cancel_mid_stream_frees_every_page(real_client) -> None:
    before = real_client.stats().engine
    stream = started_stream(real_client, "Once upon a time", ignore_eos=True, temperature=0)
    next(stream)
    assert real_client.stats().engine.num_pages_used > 0
    stream.close()
    after = wait_idle(real_client)
    assert (after.engine.num_pages_used, after.engine.num_running, after.engine.num_waiting) == (0, 0, 0)
    assert after.engine.num_pages_free == before.num_pages_free
    assert after.engine.num_generation_tokens_total - before.num_generation_tokens_total < 400


_TOO_LONG = REAL_ENGINE_KWARGS["max_model_len"]


@pytest.mark.parametrize("prompt, kwargs, code, field", [
    ("", {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ([], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("x" * (_TOO_LONG - 10), dict(max_tokens=20), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("x" * (_TOO_LONG + 1), dict(max_tokens=1), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("hi", dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("hi", dict(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("hi", dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("hi", dict(top_p=1.01), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("hi", dict(top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ([1, 2, 100_000], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ([-1], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ("x" * (MAX_MESSAGE_BYTES + 1), {}, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
])
def test_bad_input_gets_its_status_and_the_server_keeps_serving(real_client, prompt, kwargs, code,
                                                                field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        real_client.generate(prompt, **kwargs)
    assert err.value.code() == code, err.value.details()
    if field is not None:
        assert err.value.details().startswith(field + ":"), err.value.details()
    assert real_client.health() == "SERVING"
    stats = wait_idle(real_client)
    assert (stats.engine.num_pages_used, stats.engine.num_waiting, stats.num_in_flight) == (0, 0, 0)
    assert real_client.generate("ok", max_tokens=2, temperature=0).num_generated_tokens >= 1


def test_health_model_info_and_no_compilation_after_warmup(real_client) -> None:
    assert real_client.health() == "SERVING"
    info = real_client.model_info()
    assert info.max_model_len == REAL_ENGINE_KWARGS["max_model_len"] and info.vocab_size > 256
    assert info.kv_cache_dtype == "float32"  # --kv-cache-dtype auto: the model's dtype (GetModelInfo field 15)
    # The engine's counter is process-wide: other tests build engines (KV pressure, `jaxcpp generate`)
    # after the session engine's warm-up, so check that serving itself compiles nothing.
    from jaxcpp.runtime import compile_guard

    with compile_guard.forbid_compile():
        for prompt, n in (("a", 3), ("x" * 300, 5), (list(range(1, 40)), 2)):
            assert real_client.generate(prompt, max_tokens=n, temperature=0).num_generated_tokens >= 1
