"""200 streams cancelled at random points on the real tiny engine (queued, mid prefill chunk, mid decode,
right before the last token) while 8 greedy streams run beside them: every page comes back, nothing
lingers, and the 8 give exactly the tokens they give without the storm."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from jaxcpp.runtime import compile_guard
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving import AsyncClient
from tests.serving.conftest import wait_until

pytestmark = pytest.mark.slow

SURVIVORS = [f"# survivor {i}\ndef keep_{i}(x):" for i in range(8)]
SURVIVOR_TOKENS = 24
STORM = 200


async def _storm_stream(client: AsyncClient, rng: random.Random, i: int, counts: Counter[str]) -> None:
    point = rng.choice(["queued", "prefill", "decode", "last"])
    prompt = "z" * rng.randint(200, 400) if point == "prefill" else f"storm {i}: " + "y" * rng.randint(0, 60)
    max_tokens = rng.randint(6, 24)
    stream = client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    received = 0

    async def consume() -> None:
        nonlocal received
        async for _ in stream:
            received += 1
            if point == "decode" and received >= max_tokens // 2 or point == "last" and received >= max_tokens - 1:
                return

    task = asyncio.ensure_future(consume())
    if point in ("queued", "prefill"):  # cancel on a timer, before (or around) the first token
        await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.05 if point == "queued" else 0.3))
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await stream.aclose()
    counts[f"{point}, {'no token yet' if received == 0 else 'after tokens'}"] += 1


def test_cancel_storm_leaks_nothing_and_leaves_other_streams_exact(real_server, real_client, tiny_llm) -> None:
    params = SamplingParams(max_tokens=SURVIVOR_TOKENS, temperature=0, ignore_eos=True)
    engine_loop = real_server.server.engine_loop
    expected = engine_loop.submit(lambda: tiny_llm.generate(SURVIVORS, params)).result(timeout=300)
    before = real_client.stats().engine
    counts: Counter[str] = Counter()

    async def main() -> list[list[int]]:
        rng = random.Random(12)
        async with AsyncClient(f"127.0.0.1:{real_server.port}", timeout=300) as client:
            survivors = [asyncio.ensure_future(client.generate(p, max_tokens=SURVIVOR_TOKENS, temperature=0,
                                                               ignore_eos=True)) for p in SURVIVORS]
            storm = [_storm_stream(client, rng, i, counts) for i in range(STORM)]
            await asyncio.gather(*storm)
            return [out.token_ids for out in await asyncio.gather(*survivors)]

    with compile_guard.forbid_compile():  # cancelling at any point never needs a new program
        outputs = asyncio.run(main())
    print("cancel storm:", dict(counts))
    assert sum(counts.values()) == STORM
    # Every cancellation point was hit as it was meant to be: before the first token while queued or in
    # its prompt's chunks, after tokens mid-decode and one token before the end.
    for point in ("queued, no token yet", "prefill, no token yet", "decode, after tokens", "last, after tokens"):
        assert counts[point] >= 10, (point, dict(counts))
    assert outputs == [e.token_ids for e in expected]
    wait_until(lambda: real_client.stats().engine.num_pages_used == 0 and real_client.stats().num_in_flight == 0,
               timeout=30)
    after = real_client.stats()
    assert (after.engine.num_running, after.engine.num_waiting) == (0, 0)
    assert after.engine.num_pages_free == before.num_pages_free == after.engine.num_pages_total
    assert engine_loop.submit(engine_loop.engine.has_unfinished_requests).result(timeout=10) is False
