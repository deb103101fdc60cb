"""What the disaggregation tests share: the KV roles' configs, a consumer server, and the spies and
checks every such test makes (no page left held, the tokens a colocated engine picks, the offers a
consumer pulled)."""

from __future__ import annotations

import time
from typing import Any

from jaxcpp import LLM, SamplingParams
from jaxcpp.config import ServerConfig
from jaxcpp.serving import Client
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.lifecycle import ServerThread
from tests.pipeline.conftest import ENGINE_DEFAULTS

PRODUCER = '{"kv_role": "kv_producer", "kv_connector_extra_config": {"transfer_timeout_s": 3}}'
CONSUMER = '{"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 2}}'

def consumer_server(model: str, prefill_servers: str, **kwargs: Any) -> ServerThread:
    llm = LLM(model=model, **{**ENGINE_DEFAULTS, **kwargs}, kv_transfer_config=CONSUMER,
              prefill_servers=prefill_servers)
    return ServerThread(llm.engine, ServerConfig(port=0, http_port=0)).start()


def engine(server: ServerThread) -> Any:
    return server.server.engine_loop.engine


def assert_no_pages_held(*servers: ServerThread) -> None:
    """Nothing leaks: every page of every instance is free (or only cached) once the requests are done."""
    for server in servers:
        deadline = time.monotonic() + 10
        while (stats := engine(server).stats()).num_pages_used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.num_pages_used == 0 and stats.num_running == 0 and stats.num_waiting == 0, stats


def colocated_tokens(llm: LLM, prompts: list[list[int]], **sampling: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, **sampling)
    return [out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def raw_stream(client: Client, prompt: list[int], **sampling: Any) -> list[pb.GenerateResponse]:
    """Every sampling field the server takes (the client's helpers take the common ones)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParameters(**sampling))
    return list(client._stub.Generate(request, timeout=60))


def pulls(consumer: ServerThread) -> list[Any]:
    """Spy on the consumer's pulls: every offer it pulls is recorded."""
    executor = engine(consumer).executor
    seen: list[Any] = []
    real = executor.pull_kv

    def spy(offer: Any, transfer_id: int) -> Any:
        seen.append(offer)
        return real(offer, transfer_id)

    executor.pull_kv = spy
    return seen
