"""KV pressure: streams whose pages add up to 3x the cache, sent at once through the server, all finish;
the engine preempts (recomputes) to fit them, and every greedy stream equals the same request run
alone on the same engine (no pressure). A dedicated small engine: 24 pages of 16 tokens."""

from __future__ import annotations

import asyncio
import math

import pytest

from jaxcpp.config import ServerConfig
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving import AsyncClient
from jaxcpp.serving.lifecycle import ServerThread
from tests.serving.conftest import MODEL, wait_until

pytestmark = pytest.mark.slow

NUM_PAGES, PAGE = 24, 16
PROMPTS = [f"# task {i}\ndef solve_{i}(data):\n    " for i in range(8)]
MAX_TOKENS = 100


def test_three_times_the_kv_pages_finishes_with_preemptions_and_exact_outputs() -> None:
    from jaxcpp import LLM

    llm = LLM(model=MODEL, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
              num_pages=NUM_PAGES, page_size=PAGE, log_stats_interval_s=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]  # one at a time: never short of pages
    needed = sum(math.ceil((len(o.prompt_token_ids) + MAX_TOKENS) / PAGE) for o in alone)
    assert needed >= 3 * NUM_PAGES, needed
    preemptions_before = llm.engine.stats().num_preemptions_total

    with ServerThread(llm.engine, ServerConfig(port=0, http_port=0)) as server:
        async def main() -> list:
            async with AsyncClient(f"127.0.0.1:{server.port}", timeout=300) as client:
                async def one(prompt: str) -> list[int]:
                    return [t async for d in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                           ignore_eos=True) for t in d.token_ids]
                return await asyncio.gather(*(one(p) for p in PROMPTS))

        streamed = asyncio.run(main())
        wait_until(lambda: server.server.admission.num_in_flight == 0)
        stats = server.server.engine_loop.submit(llm.engine.stats).result(timeout=30)

    print(f"KV pressure: {needed} pages needed of {NUM_PAGES}, "
          f"{stats.num_preemptions_total - preemptions_before} preemptions")
    assert stats.num_preemptions_total - preemptions_before > 0
    assert streamed == [o.token_ids for o in alone]  # streamed tokens: no duplicates after a recompute
    assert (stats.num_pages_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
