"""Disaggregating an MLA model (DeepSeek-V3, random tiny): latent pages cross as K and V pages do. A
producer of two stage processes (the dense layers on one, the MoE layers on the other) prefills, a
consumer pulls one latent array a layer ([pages, page size, 1, kv_lora_rank + qk_rope_head_dim], no V)
from each stage process and decodes: every token is the one a colocated engine picks, and the bytes that
cross are the latent rows' (40 values a token a layer here, where 4 heads of K and V of 8 would be 64)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from jaxcpp import LLM
from jaxcpp.config import ServerConfig
from jaxcpp.core.kv_transfer import page_bucket
from jaxcpp.runtime.compile_guard import forbid_compile
from jaxcpp.serving import Client, ClientError
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.lifecycle import ServerThread
from tests.disagg.support import (
    PRODUCER,
    assert_no_pages_held,
    colocated_tokens,
    consumer_server,
    engine,
    pulls,
)
from tests.pipeline.conftest import ENGINE_DEFAULTS, write_random_model
from tests.pipeline.test_deepseek_pipeline import RANK, ROPE, write_random_deepseek

pytestmark = pytest.mark.slow
LAYERS = 4  # deepseek_config's: layers 0-1 dense, 2-3 MoE
PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([5, 40, 150, 17])]


def latent_bytes(prompts: list[list[int]], itemsize: int) -> int:
    """What crosses for `prompts`: each layer's latent rows of their page buckets, nothing else."""
    return LAYERS * 16 * (RANK + ROPE) * itemsize * sum(page_bucket(-(-len(p) // 16)) for p in prompts)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_deepseek(tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="module")
def producer(model: str) -> Iterator[ServerThread]:
    llm = LLM(model=model, **ENGINE_DEFAULTS, pipeline_parallel_size=2, distributed_executor_backend="mp",
              kv_transfer_config=PRODUCER)
    server = ServerThread(llm.engine, ServerConfig(port=0, http_port=0)).start()
    yield server
    server.stop(grace=0)


def test_latent_pages_cross_and_give_a_colocated_engines_tokens(client, consumer, producer, colocated):
    want = colocated_tokens(colocated, PROMPTS)
    offers = pulls(consumer)
    try:
        with forbid_compile():  # this process (the consumer): its latent scatter was compiled at warm-up
            got = [client.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
    finally:
        del engine(consumer).executor.pull_kv
    assert got == want
    stats = engine(consumer).stats()
    assert stats.num_kv_transfers_total == len(PROMPTS) and stats.num_prompt_tokens_total == 0
    assert stats.num_kv_transfer_bytes_total == latent_bytes(PROMPTS, 4), "one float32 latent row a token a layer"
    assert all([(s.first_layer, s.end_layer) for s in o.sources] == [(0, 2), (2, 4)] for o in offers), \
        "each stage process offered its own layers"
    for stage in engine(consumer).executor.stages:
        assert [a.shape for a in stage.pages_avals(4)] == [(4, 16, 1, RANK + ROPE)], "no V"


def test_prefix_cached_latent_pages_on_the_consumer(client, consumer, producer, colocated):
    """The consumer's own cached latent pages serve the shared prefix; only the rest crosses."""
    prefix = [(5 * j) % 100 + 3 for j in range(128)]
    prompts = [prefix + [7, 8, 9], prefix + [11, 12]]
    want = colocated_tokens(colocated, prompts)
    offers = pulls(consumer)
    try:
        first = client.generate(prompts[0], max_tokens=12, temperature=0)
        second = client.generate(prompts[1], max_tokens=12, temperature=0)
    finally:
        del engine(consumer).executor.pull_kv
    assert [first.token_ids, second.token_ids] == want
    assert second.num_cached_tokens == 128, "the consumer's own prefix cache gave the shared 8 latent pages"
    assert [o.num_pages for o in offers] == [9, 1], "so the second pull carried only the last page"


def test_a_mismatched_layout_is_refused_naming_the_field(model, producer, tmp_path):
    """An MHA consumer (a Llama of as many layers) against the latent producer: refused at connect, naming
    the latent fields; a producer refuses a consumer's latent layout of another rank itself."""
    mha = write_random_model(tmp_path / "mha", num_layers=LAYERS)
    consumer = consumer_server(mha, f"127.0.0.1:{producer.port}")
    try:
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
            with pytest.raises(ClientError) as err:
                c.generate(PROMPTS[1], max_tokens=4)
        message = err.value.message
        assert f"kv_lora_rank 0 (this consumer) vs {RANK} (producer 127.0.0.1:" in message, message
        assert f"head_dim 16 (this consumer) vs {RANK + ROPE} (producer" in message, message
        assert_no_pages_held(consumer, producer)
    finally:
        consumer.stop(grace=0)
    layout = engine(producer).kv_layout
    assert (layout.num_kv_heads, layout.head_dim, layout.kv_lora_rank, layout.qk_rope_head_dim) == (
        1, RANK + ROPE, RANK, ROPE)
    with Client(f"127.0.0.1:{producer.port}") as c:
        theirs = pb.KvLayout(model=layout.model, num_layers=LAYERS, page_size=16, kv_cache_dtype="float32",
                             num_kv_heads=1, head_dim=RANK + ROPE, kv_lora_rank=RANK - 8, qk_rope_head_dim=ROPE + 8)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParameters(max_tokens=1),
                                     kv_transfer=pb.KvTransferRequest(transfer_id=1, layout=theirs))
        with pytest.raises(Exception) as refused:
            list(pb_grpc.JaxcppServiceStub(c.channel).Generate(request))
    assert refused.value.code().name == "FAILED_PRECONDITION"
    details = refused.value.details()
    assert f"kv_lora_rank {RANK} (this producer) vs {RANK - 8} (consumer" in details, details
    assert f"qk_rope_head_dim {ROPE} (this producer) vs {ROPE + 8}" in details and "model" not in details, details


def test_fp8_latent_pages_cross_from_an_in_process_producer(model):
    """float8 latent rows (the per-layer scale is the checkpoint's on both sides: only pages cross), from a
    producer whose two stages share one process, into a TP 2 consumer (the latent pages replicated on both
    devices, as a consumer's PP 1 x TP N holds them): tokens equal a colocated fp8 engine's, one byte a value."""
    fp8: dict[str, Any] = dict(kv_cache_dtype="fp8")
    producer = ServerThread(LLM(model=model, **ENGINE_DEFAULTS, **fp8, pipeline_parallel_size=2,
                                kv_transfer_config=PRODUCER).engine, ServerConfig(port=0, http_port=0)).start()
    consumer = consumer_server(model, f"127.0.0.1:{producer.port}", **fp8, tensor_parallel_size=2)
    try:
        want = colocated_tokens(LLM(model=model, **ENGINE_DEFAULTS, **fp8), PROMPTS)
        offers = pulls(consumer)
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as c:
            got = [c.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
        del engine(consumer).executor.pull_kv
        assert got == want
        assert [[(s.first_layer, s.end_layer) for s in o.sources] for o in offers] == [[(0, LAYERS)]] * len(PROMPTS)
        assert engine(consumer).stats().num_kv_transfer_bytes_total == latent_bytes(PROMPTS, 1), "one byte a value"
        pages = np.asarray(engine(consumer).executor.stages[0].kv.k)
        assert pages.dtype.itemsize == 1 and np.abs(pages.astype(np.float32)).sum() > 0
        assert_no_pages_held(consumer, producer)
    finally:
        consumer.stop(grace=0)
        producer.stop(grace=0)

