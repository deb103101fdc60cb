"""Prefill-decode disaggregation on CPU processes over loopback: a producer (PP 2 stage processes, dynamic
chunking on) prefills, a consumer (the clients' entry) pulls the KV pages from the producer's stage
processes over jax's transfer servers and decodes. Every token must be the one a colocated engine picks,
and after every test each instance's pages are all free again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jaxcpp import LLM, SamplingParams
from jaxcpp.config import ServerConfig
from jaxcpp.core.kv_transfer import page_bucket
from jaxcpp.head.supervision import free_port
from jaxcpp.serving import Client, ClientError
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.lifecycle import ServerThread
from tests.disagg.support import (
    CONSUMER,
    PRODUCER,
    assert_no_pages_held,
    colocated_tokens,
    consumer_server,
    engine,
    pulls,
    raw_stream,
)
from tests.pipeline.conftest import ENGINE_DEFAULTS, write_random_model

pytestmark = pytest.mark.slow

# chunked prefill: prompts up to 150 tokens with a 64-token budget
PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([5, 40, 150, 17, 90, 64])]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_model(tmp_path_factory.mktemp("disagg_model"))


@pytest.fixture(scope="module")
def producer(model: str) -> Iterator[ServerThread]:
    llm = LLM(model=model, **ENGINE_DEFAULTS, pipeline_parallel_size=2, distributed_executor_backend="mp",
              enable_dynamic_chunking=True, dynamic_chunking_min_chunk_size=16, kv_transfer_config=PRODUCER)
    server = ServerThread(llm.engine, ServerConfig(port=0, http_port=0)).start()
    yield server
    server.stop(grace=0)


def test_greedy_tokens_match_a_colocated_engine(client, consumer, producer, colocated):
    want = colocated_tokens(colocated, PROMPTS)
    offers = pulls(consumer)
    before = engine(consumer).stats()
    got = [client.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
    assert got == want
    after = engine(consumer).stats()
    page_bytes = 2 * 6 * 16 * 2 * 16 * 4  # K and V, 6 layers, 16 tokens, 2 KV heads of 16, float32
    assert after.num_kv_transfers_total - before.num_kv_transfers_total == len(PROMPTS)
    assert after.num_kv_transfer_bytes_total - before.num_kv_transfer_bytes_total == page_bytes * sum(
        page_bucket(-(-len(p) // 16)) for p in PROMPTS)
    assert after.num_kv_transfer_tokens_total - before.num_kv_transfer_tokens_total == sum(map(len, PROMPTS))
    # every prompt was prefilled by the producer's two stage processes, each offering its own layers
    assert len(offers) == len(PROMPTS)
    assert all([(s.first_layer, s.end_layer) for s in o.sources] == [(0, 3), (3, 6)] for o in offers)
    assert [o.num_pages for o in offers] == [-(-len(p) // 16) for p in PROMPTS]
    assert engine(producer).chunking.stats()["state"] != "off", "dynamic chunking runs on the producer"
    assert engine(consumer).chunking is None, "and never on the consumer"
    assert engine(consumer).stats().num_prompt_tokens_total == 0, "the consumer prefilled nothing itself"
    del engine(consumer).executor.pull_kv


def test_concurrent_requests(client, colocated):
    want = colocated_tokens(colocated, PROMPTS)
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = client.generate(PROMPTS[i], max_tokens=12, temperature=0).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(PROMPTS))] == want


def test_the_openai_api_on_the_consumer(client, consumer, colocated, model):
    """The consumer is the entry for both APIs: an OpenAI completion is prefilled remotely too."""
    import json
    import urllib.request

    body = json.dumps({"model": model, "prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{consumer.http_port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    before = engine(consumer).stats().num_kv_transfers_total
    with urllib.request.urlopen(request, timeout=60) as response:
        out = json.loads(response.read())
    assert out["usage"]["completion_tokens"] == 12
    assert engine(consumer).stats().num_kv_transfers_total == before + 1
    [want] = colocated_tokens(colocated, [PROMPTS[4]])
    streamed = client.generate(PROMPTS[4], max_tokens=12, temperature=0).token_ids
    assert streamed == want


def test_seeded_sampling_and_logprobs_match(client, colocated):
    """The seed travels with the request: the producer samples the first token as the consumer would."""
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=5, logprobs=2)
    [want] = colocated.generate(prompt_token_ids=[prompt], sampling_params=params)
    responses = raw_stream(client, prompt, max_tokens=12, temperature=0.9, top_k=20, seed=5, logprobs=2)
    assert [t for r in responses for t in r.token_ids] == want.token_ids
    got_logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in got_logprobs] == want.token_ids
    assert [round(lp.logprob, 4) for lp in got_logprobs] == [round(lp.logprob, 4) for lp in want.logprobs]


def test_shared_prefix_pulls_only_the_rest(client, consumer, producer, colocated):
    """Prefix caching on both sides: the consumer asks only for the pages it lacks, and the producer
    prefills from its own cached prefix."""
    prefix = [(5 * j) % 100 + 3 for j in range(128)]
    prompts = [prefix + [7, 8, 9], prefix + [11, 12]]
    want = colocated_tokens(colocated, prompts)
    offers = pulls(consumer)
    first = client.generate(prompts[0], max_tokens=12, temperature=0)
    hits = engine(producer).stats().num_prefix_cache_hit_tokens_total
    second = client.generate(prompts[1], max_tokens=12, temperature=0)
    assert engine(producer).stats().num_prefix_cache_hit_tokens_total - hits == 128
    del engine(consumer).executor.pull_kv
    assert [first.token_ids, second.token_ids] == want
    assert second.num_cached_tokens == 128, "the consumer's own prefix cache gave the shared 8 pages"
    assert [o.num_pages for o in offers] == [9, 1], "so the second pull carried only the last page"


def test_a_request_with_penalties_is_prefilled_on_the_consumer(client, consumer, colocated):
    """Penalties count every prompt token on the device that samples: that prompt stays where it decodes."""
    want = colocated_tokens(colocated, PROMPTS[:2], repetition_penalty=1.3)
    before = engine(consumer).stats().num_prompt_tokens_total
    got = [[t for r in raw_stream(client, p, max_tokens=12, temperature=0, repetition_penalty=1.3) for t in r.token_ids]
           for p in PROMPTS[:2]]
    assert got == want
    assert engine(consumer).stats().num_prompt_tokens_total - before == len(PROMPTS[0]) + len(PROMPTS[1])


def test_abort_during_transfer_frees_both_sides(client, consumer, producer):
    """The client goes away while the consumer pulls: its pages come back on both sides, the pull is
    dropped (never written), and the next request is served. The pull is held: it never counts as arrived
    until the test releases it (the engine's thread polls it; nothing blocks)."""
    executor = engine(consumer).executor
    pulling, release = threading.Event(), threading.Event()
    real_pull, real_arrived = executor.pull_kv, executor.kv_arrived

    def started(offer: Any, transfer_id: int) -> Any:
        pulling.set()
        return real_pull(offer, transfer_id)

    executor.pull_kv = started
    executor.kv_arrived = lambda pull: release.is_set() and real_arrived(pull)
    try:
        call = client._stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[2]),
                                                        sampling=pb.SamplingParameters(max_tokens=8)))
        assert pulling.wait(30)
        assert engine(consumer).stats().num_pages_used == 10, "its prompt's pages were reserved"
        call.cancel()
        assert_no_pages_held(consumer, producer)
    finally:
        release.set()
        del executor.pull_kv, executor.kv_arrived
    assert client.generate(PROMPTS[0], max_tokens=4, temperature=0).token_ids


def test_an_offer_no_one_pulls_times_out_on_both_sides(client, consumer, producer):
    """The consumer pulls too late (past the producer's 3 s): the producer has dropped its offer, the
    consumer's wait ends at its own 2 s (from the offer's arrival), its pages are freed and the request
    fails naming why. (The late start blocks the engine's thread: this test runs one request.)"""
    executor = engine(consumer).executor
    real = executor.pull_kv

    def late(offer: Any, transfer_id: int) -> Any:
        time.sleep(3.5)
        return real(offer, transfer_id)

    executor.pull_kv = late
    try:
        with pytest.raises(ClientError) as err:
            client.generate(PROMPTS[1], max_tokens=8, temperature=0)
    finally:
        del executor.pull_kv
    assert "did not arrive within the transfer timeout (2s)" in err.value.message
    assert f"127.0.0.1:{producer.port}" in err.value.message


def test_mismatched_consumer_is_refused_naming_both_sides(model, producer):
    consumer = consumer_server(model, f"127.0.0.1:{producer.port}", page_size=32)
    try:
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
            with pytest.raises(ClientError) as err:
                c.generate(PROMPTS[1], max_tokens=4)
        message = err.value.message
        assert "page_size 32 (this consumer) vs 16 (producer 127.0.0.1:" in message, message
        assert_no_pages_held(consumer, producer)
    finally:
        consumer.stop(grace=0)
    # and the producer refuses such a request itself, naming both sides
    with Client(f"127.0.0.1:{producer.port}") as c:
        stub = pb_grpc.JaxcppServiceStub(c.channel)
        layout = pb.KvLayout(model="other", num_layers=6, page_size=16, kv_cache_dtype="float32", num_kv_heads=2,
                             head_dim=16)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParameters(max_tokens=1),
                                     kv_transfer=pb.KvTransferRequest(transfer_id=1, layout=layout))
        with pytest.raises(Exception) as refused:
            list(stub.Generate(request))
    assert refused.value.code().name == "FAILED_PRECONDITION"
    assert "model" in refused.value.details() and "(this producer)" in refused.value.details()


def test_a_killed_producer_is_passed_over_for_another(model, producer, colocated, tmp_path, caplog):
    """Two producers; the first in the list (so the first choice) is a `jaxcpp serve` process, SIGKILLed:
    the consumer's request goes to the other, with the same tokens, and nothing leaks."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--port", str(port), "--no-enable-http",
         "--kv-transfer-config", PRODUCER, *engine_flags()],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "producer.log", "wb"))
    consumer = consumer_server(model, f"127.0.0.1:{port},127.0.0.1:{producer.port}")
    try:
        with Client(f"127.0.0.1:{port}") as c:
            c.wait_ready(120)
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
            offers = pulls(consumer)
            assert c.generate(PROMPTS[0], max_tokens=4, temperature=0).token_ids
            assert {s.address for s in offers[-1].sources}.isdisjoint(producer_sources(producer)), \
                "the first request went to the subprocess producer"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            want = colocated_tokens(colocated, PROMPTS[:3])
            assert [c.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS[:3]] == want
            assert all(set(s.address for s in o.sources) == producer_sources(producer) for o in offers[1:])
        retried = [r.getMessage() for r in caplog.records if "trying another" in r.getMessage()]
        assert retried and f"producer 127.0.0.1:{port} failed request" in retried[0], retried
        assert_no_pages_held(consumer, producer)
    finally:
        proc.kill()
        consumer.stop(grace=0)


def producer_sources(producer: ServerThread) -> set[str]:
    return {ln.transfer for ln in engine(producer).executor.links}


def engine_flags() -> list[str]:
    flags = []
    for name, value in ENGINE_DEFAULTS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def test_a_killed_consumer_ends_its_streams_unavailable(model, producer, tmp_path):
    """The consumer is the clients' entry: when it dies its streams end UNAVAILABLE, and its producer,
    whose calls gRPC cancels, holds nothing of its requests afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", model, "--port", str(port),
         "--no-enable-http", "--kv-transfer-config", CONSUMER, "--prefill-servers", f"127.0.0.1:{producer.port}",
         *engine_flags()], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "consumer.log", "wb"))
    try:
        with Client(f"127.0.0.1:{port}", timeout=60) as c:
            c.wait_ready(120)
            stream = c.stream(PROMPTS[1], max_tokens=200, temperature=0, ignore_eos=True)
            assert next(stream).token_ids, "its first token came back"
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(ClientError) as err:
                for _ in stream:
                    pass
        assert err.value.status.name == "UNAVAILABLE"
        assert_no_pages_held(producer)
    finally:
        proc.kill()


def test_an_in_process_producer_and_fp8_pages(model):
    """The other executor on the producer's side (its stages in one process, one transfer server for all
    its layers), with float8 pages: they cross as they are, and the tokens are the colocated fp8 engine's."""
    fp8 = dict(kv_cache_dtype="fp8")
    producer = ServerThread(LLM(model=model, **ENGINE_DEFAULTS, **fp8, pipeline_parallel_size=2,
                                kv_transfer_config=PRODUCER).engine, ServerConfig(port=0, http_port=0)).start()
    consumer = consumer_server(model, f"127.0.0.1:{producer.port}", **fp8)
    try:
        want = colocated_tokens(LLM(model=model, **ENGINE_DEFAULTS, **fp8), PROMPTS[:4])
        offers = pulls(consumer)
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
            got = [c.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS[:4]]
        assert got == want
        assert [[(s.first_layer, s.end_layer) for s in o.sources] for o in offers] == [[(0, 6)]] * 4
        assert engine(consumer).stats().num_kv_transfer_bytes_total == 2 * 6 * 16 * 2 * 16 * 1 * sum(
            page_bucket(-(-len(p) // 16)) for p in PROMPTS[:4]), "one byte a value"
        assert_no_pages_held(consumer, producer)
    finally:
        consumer.stop(grace=0)
        producer.stop(grace=0)
