"""Disaggregation's host side, without devices: the flags, the page buckets, the layout check, and the
consumer's choice of producer."""

from __future__ import annotations

import json
import logging
import time

import pytest

from jaxcpp.cli_args import engine_config_from_args
from jaxcpp.config import ConfigError, EngineConfig
from jaxcpp.core.kv_transfer import KVLayout, padded_pages, page_bucket, page_buckets
from jaxcpp.serving.cli import build_parser
from jaxcpp.serving.disaggregation import GrpcRemotePrefill, expand_targets

CONSUMER = '{"kv_role": "kv_consumer"}'


def test_roles_parse_and_dynamic_chunking_is_turned_off_with_a_warning_on_a_consumer(caplog):
    flags = ["serve", "--kv-transfer-config", CONSUMER, "--prefill-servers", "10.0.0.2:50051",
             "--enable-dynamic-chunking"]
    with caplog.at_level(logging.WARNING, logger="jaxcpp.cli_args"):  # the command line logs what is off
        consumer = engine_config_from_args(build_parser().parse_args(flags))
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


def test_the_fake_remote_has_the_contract_s_methods_and_no_other():
    from jaxcpp.core.kv_transfer import RemotePrefill

    def methods(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    assert methods(_FakeRemote) == methods(RemotePrefill)


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
    remote = GrpcRemotePrefill(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], KVLayout("m", 6, 16, "float32", 2, 16))
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
    """A RemotePrefill (every method of the protocol, no other) that ends jobs when the test says so, and
    records the pulls handed back to it."""

    def __init__(self) -> None:
        self.started: list = []
        self.ended: list = []
        self.retried: list = []

    def start(self, job) -> None:
        self.started.append(job)

    def retry(self, done, error: str) -> None:
        self.retried.append((done, error))

    def cancel(self, job) -> None:
        pass

    def done(self, wait_s: float) -> list:
        ended, self.ended = self.ended, []
        return ended

    def unready_reason(self) -> str | None:
        return None  # its one producer is always ready

    def close(self) -> None:
        pass


def consumer_engine(timeout_s: float = 60.0):
    """A kv_consumer engine on the fake executor (its KV sub-protocols declared), with a fake remote."""
    from jaxcpp.core.engine import LLMEngine
    from jaxcpp.core.fake_executor import FakeExecutor

    config = EngineConfig.from_kwargs(
        model="tiny", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, log_stats_interval_s=0,
        kv_transfer_config=json.dumps({"kv_role": "kv_consumer",
                                       "kv_connector_extra_config": {"transfer_timeout_s": timeout_s}}),
        prefill_servers="p:1")
    engine = LLMEngine(config, executor=FakeExecutor())
    remote = _FakeRemote()
    engine.attach_remote_prefill(remote)
    return engine, engine.executor, remote


def offered(job, first_token: int, transfer_id: int, producer: str = "p:1"):
    from jaxcpp.core.kv_transfer import KVOffer, KVSource, RemoteDone

    num_pages = -(-len(job.prompt_token_ids) // 16) - job.skip_pages
    return RemoteDone(job, first_token, offer=KVOffer((KVSource("x", 0, 1),), num_pages), transfer_id=transfer_id,
                      producer=producer)


def test_a_request_sent_again_under_its_id_never_takes_the_aborted_jobs_pages():
    """Abort a remote request while its job runs, send another under the same id: the first job's end
    (pages offered for the old prompt) is dropped, the second's is pulled, written and admitted."""
    from jaxcpp.sampling_params import SamplingParams

    engine, executor, remote = consumer_engine()
    params = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request("r", [5] * 40, params)
    engine.step()
    engine.abort_request("r")
    engine.add_request("r", [6] * 20, params)
    engine.step()
    old, new = remote.started
    assert old.request_id == new.request_id == "r" and old is not new
    remote.ended = [offered(old, 9, transfer_id=1), offered(new, 7, transfer_id=2)]
    outputs = engine.step()
    assert [p.transfer_id for p in executor.imported] == [2], "the aborted job's pages are never written"
    assert [o.new_token_ids for o in outputs if o.request_id == "r"][-1:] == [[7]]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_pages_used == 0
    engine.close()


def test_the_engine_polls_a_pull_and_imports_it_once_it_has_arrived():
    """The pull starts on the engine's thread and never blocks it: steps go on while the pages land, and the
    request is admitted (first token out) only by the step that sees them arrived."""
    from jaxcpp.sampling_params import SamplingParams

    engine, executor, remote = consumer_engine()
    executor.pulls_arrive = False
    engine.add_request("a", [3] * 40, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    [job] = remote.started
    remote.ended = [offered(job, 11, transfer_id=5)]
    assert engine.step() == [] and [p.transfer_id for p in executor.pulls] == [5]
    assert engine.step() == [] and executor.imported == [], "not arrived: not written, not admitted"
    executor.pulls[0].arrived = True
    outputs = engine.step()
    assert executor.imported == executor.pulls and [o.new_token_ids for o in outputs] == [[11]]
    assert engine.stats().num_kv_transfers_total == 1 and engine.stats().num_kv_transfer_tokens_total == 40
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_pages_used == 0 and not remote.retried
    engine.close()


@pytest.mark.parametrize("how", ["timeout", "failed"])
def test_a_pull_that_fails_or_times_out_goes_back_to_the_remote_side(how):
    """Past the transfer timeout, or failed, a pull is handed back (`retry`) for the next producer, and that
    producer's offer is pulled in turn; the first pull is never written."""
    from jaxcpp.sampling_params import SamplingParams

    engine, executor, remote = consumer_engine(timeout_s=0.05)
    executor.pulls_arrive = False
    engine.add_request("a", [3] * 20, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    [job] = remote.started
    remote.ended = [offered(job, 11, transfer_id=5, producer="p:1")]
    engine.step()
    if how == "timeout":
        time.sleep(0.06)
    else:
        executor.pulls[0].arrived = ConnectionError("connection reset")
    assert engine.step() == []
    [(done, error)] = remote.retried
    assert done.job is job and done.producer == "p:1"
    assert error == ("its pages did not arrive within the transfer timeout (0.05s)" if how == "timeout"
                     else "pulling its pages failed: connection reset")
    executor.pulls_arrive = True
    remote.ended = [offered(job, 11, transfer_id=6, producer="p:2")]
    assert [o.new_token_ids for o in engine.step()] == [[11]]
    assert [p.transfer_id for p in executor.imported] == [6]
    engine.abort_request("a")
    engine.close()


def test_a_pull_handed_back_with_no_producer_left_fails_naming_each_error():
    """The remote side's retry passes the failed producer over; with none left the request ends UNAVAILABLE
    naming every producer's error (the earlier ones travel with the job)."""
    from jaxcpp.core.kv_transfer import RemoteDone, RemoteJob
    from jaxcpp.sampling_params import SamplingParams

    remote = GrpcRemotePrefill(["127.0.0.1:1", "127.0.0.1:2"], KVLayout("m", 6, 16, "float32", 2, 16))
    try:
        job = RemoteJob("a", [1, 2, 3], SamplingParams(), 0, 0)
        remote.retry(RemoteDone(job, 5, producer="127.0.0.1:2", tried=("127.0.0.1:1",),
                                errors=("producer 127.0.0.1:1: UNAVAILABLE: down",)), "its pages did not arrive")
        [done] = remote.done(wait_s=10)
        assert done.job is job and done.unavailable
        assert done.error == ("no producer could prefill it: producer 127.0.0.1:1: UNAVAILABLE: down; "
                              "producer 127.0.0.1:2: its pages did not arrive")
        assert remote._producers[1].down_until > time.monotonic(), "passed over for a while"
    finally:
        remote.close()
