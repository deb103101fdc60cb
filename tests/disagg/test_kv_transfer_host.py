"""Disaggregation's host side, without devices: the flags, the page buckets, the layout check, and the
consumer's choice of producer."""

from __future__ import annotations

import logging
import time

import pytest

from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.kv_transfer import KVLayout, padded_pages, page_bucket, page_buckets
from jaxcpp.serving.disaggregation import GrpcRemotePrefill, expand_targets

CONSUMER = '{"kv_role": "kv_consumer"}'


def test_roles_parse_and_dynamic_chunking_is_turned_off_with_a_warning_on_a_consumer(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxcpp.config"):
        consumer = EngineConfig.from_kwargs(kv_transfer_config=CONSUMER, prefill_servers="10.0.0.2:50051",
                                            enable_dynamic_chunking=True)
    assert consumer.kv_transfer.settings().consumes and not consumer.dynamic_chunking
    assert "--enable-dynamic-chunking is off on a kv_consumer" in caplog.text
    producer = EngineConfig.from_kwargs(kv_transfer_config='{"kv_role": "kv_producer", "kv_ip": "10.0.0.3"}',
                                        pipeline_parallel_size=2, enable_dynamic_chunking=True)
    kv = producer.kv_transfer.settings()
    assert kv.produces and not kv.consumes and kv.ip == "10.0.0.3" and producer.dynamic_chunking
    both = EngineConfig.from_kwargs(kv_transfer_config='{"kv_role": "kv_both"}').kv_transfer.settings()
    assert both.produces and both.consumes and both.transfer_timeout_s == 60.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_transfer_config='{"kv_role": "prefill"}'), "--kv-transfer-config: kv_role: one of"),
    (dict(kv_transfer_config="{kv_role: x}"), "--kv-transfer-config: not JSON"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer", "kv_buffer": 1}'), "unknown key(s) ['kv_buffer']"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}'), "kv_connector: only"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer", "kv_ip": "pod-0"}'), "kv_ip: an IP address"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer", "kv_connector_extra_config": {"transfer_timeout_s": 0}}'),
     "transfer_timeout_s: seconds > 0"),
    (dict(kv_transfer_config=CONSUMER), "--prefill-servers: a kv_consumer needs"),
    (dict(prefill_servers="10.0.0.2:50051"), "--prefill-servers: is for a consumer"),
    (dict(kv_transfer_config=CONSUMER, prefill_servers="10.0.0.2"), "--prefill-servers: expected host:port"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer"}', kv_cache_dtype="fp8", calculate_kv_scales=True),
     "--calculate-kv-scales: cannot be used with --kv-transfer-config"),
    (dict(kv_transfer_config='{"kv_role": "kv_both"}', prefill_servers="a:1", pipeline_parallel_size=2,
          distributed_executor_backend="mp"), "--kv-transfer-config: a kv_consumer pulls KV pages"),
    (dict(kv_transfer_config=CONSUMER, prefill_servers="a:1", pipeline_parallel_size=2,
          distributed_executor_backend="mp"), "--kv-transfer-config: a kv_consumer pulls KV pages"),
])
def test_bad_settings_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_kwargs(**kwargs)
    assert message in str(err.value)


def test_page_buckets_are_powers_of_two_on_both_sides():
    assert page_buckets(16) == [1, 2, 4, 8, 16] and page_buckets(17) == [1, 2, 4, 8, 16, 32]
    assert [page_bucket(n) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 32]
    assert padded_pages([7, 8, 9]) == [7, 8, 9, 0], "padding reads and writes the reserved page 0"


def test_a_layout_mismatch_names_every_field_and_both_sides():
    mine = KVLayout("m", 6, 16, "float32", 2, 16)
    assert mine.mismatch(mine, "a", "b") is None
    theirs = KVLayout("m", 6, 32, "bfloat16", 2, 16)
    assert mine.mismatch(theirs, "this consumer", "producer p:1") == (
        "KV layouts differ: page_size 16 (this consumer) vs 32 (producer p:1); "
        "kv_cache_dtype 'float32' (this consumer) vs 'bfloat16' (producer p:1)")


def test_the_least_loaded_producer_is_picked_and_a_failed_one_passed_over():
    remote = GrpcRemotePrefill(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], KVLayout("m", 6, 16, "float32", 2, 16),
                               executor=None, transfer_timeout_s=1)
    try:
        a, b, c = remote._producers
        for p in (a, b, c):
            p.checked = True
        a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
        assert remote._pick(set()) is b
        assert remote._pick({b.target}) is c, "one not tried yet"
        b.down_until = time.monotonic() + 60
        assert remote._pick(set()) is c, "a producer that just failed waits while others are up"
        c.refused = "layouts differ"
        assert remote._pick(set()) is a
        a.down_until = time.monotonic() + 60
        assert remote._pick(set()) is b, "when all are down, the least loaded is tried all the same"
        assert remote._pick({a.target, b.target}) is None, "refused ones never"
    finally:
        remote.close()


def test_a_name_with_several_addresses_is_that_many_producers(monkeypatch):
    import socket

    real = socket.getaddrinfo
    pods = {"prefill-leaders": ["10.1.0.7", "10.1.0.9", "10.1.0.7"]}

    def resolve(host, port, *args, **kwargs):
        if host not in pods:
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in pods[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert expand_targets(["prefill-leaders:50051", "127.0.0.1:5", "127.0.0.1:5"]) == [
        "10.1.0.7:50051", "10.1.0.9:50051", "127.0.0.1:5"]
    assert expand_targets(["no-such-host.invalid:50051"]) == ["no-such-host.invalid:50051"], "kept for later"


class _FakeRemote:
    """A RemotePrefill that ends jobs when the test says so; the pull is a token the executor records."""

    def __init__(self) -> None:
        self.started: list = []
        self.ended: list = []

    def start(self, job) -> None:
        self.started.append(job)

    def cancel(self, job) -> None:
        pass

    def done(self, wait_s: float) -> list:
        ended, self.ended = self.ended, []
        return ended

    def close(self) -> None:
        pass


def test_a_request_sent_again_under_its_id_never_takes_the_aborted_jobs_pages():
    """Abort a remote request while its job runs, send another under the same id: the first job's end
    (pages pulled for the old prompt) is dropped, the second's is written and admitted."""
    from jaxcpp.core.engine import LLMEngine
    from jaxcpp.core.fake_executor import FakeExecutor
    from jaxcpp.core.kv_transfer import RemoteDone
    from jaxcpp.sampling_params import SamplingParams

    executor = FakeExecutor()
    imported: list = []
    executor.import_kv = lambda pulled, pages: imported.append(pulled)  # type: ignore[attr-defined]
    config = EngineConfig.from_kwargs(model="tiny", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                                      log_stats_interval_s=0, kv_transfer_config=CONSUMER, prefill_servers="p:1")
    engine = LLMEngine(config, executor=executor)
    remote = _FakeRemote()
    engine.attach_remote_prefill(remote)
    params = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request("r", [5] * 40, params)
    engine.step()
    engine.abort_request("r")
    engine.add_request("r", [6] * 20, params)
    engine.step()
    old, new = remote.started
    assert old.request_id == new.request_id == "r" and old is not new
    remote.ended = [RemoteDone(old, first_token=9, pulled="old pages"), RemoteDone(new, first_token=7, pulled="new")]
    outputs = engine.step()
    assert imported == ["new"], "the aborted job's pages are never written"
    assert [o.new_token_ids for o in outputs if o.request_id == "r"][-1:] == [[7]]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_pages_used == 0
    engine.close()
