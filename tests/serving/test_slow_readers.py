"""Clients that stop reading: the server buffers at most --max-stream-buffer responses per stream, then
aborts the request (pages freed, queue slot released) and ends the call with RESOURCE_EXHAUSTED, while
the normal streams next to them finish with the right tokens. The throughput comparison (within 20%)
is a benchmark, not a timed assertion: benchmarks/slow_readers.py."""

from __future__ import annotations

import threading
import time

import grpc

from jaxcpp.serving import Client
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from tests.serving.conftest import wait_until
from tests.serving.fakes import expected_tokens, fake_engine

# A receive window of 1 KiB (and no BDP growth) makes the client's transport stop accepting data
# after ~30 responses, as a real stuck client's would after its window; the server's write then blocks.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
BUFFER = 16


def _stuck_stream(target: str, prompt: bytes, max_tokens: int) -> tuple[grpc.Channel, object]:
    channel = grpc.insecure_channel(target, options=SMALL_WINDOW)
    stub = pb_grpc.JaxcppServiceStub(channel)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)),
                                 sampling=pb.SamplingParameters(max_tokens=max_tokens, ignore_eos=True))
    call = stub.Generate(request, timeout=60)
    next(call)  # admitted and running; from now on nobody reads (dead) or reads once a second (slow)
    return channel, call


def test_dead_and_slow_readers_are_cut_off_and_normal_streams_finish(serve) -> None:
    engine = fake_engine(step_delay_s=0.002, max_model_len=2048, num_pages=4096, max_num_seqs=64)
    server = serve(engine, max_stream_buffer=BUFFER)
    target = f"127.0.0.1:{server.port}"
    stuck = [_stuck_stream(target, b"stuck %d" % i, 2000) for i in range(32)]
    slow_codes: list[grpc.StatusCode] = []
    drain = threading.Event()  # once the normal streams are done, read what is left without waiting

    def read_slowly(call) -> None:
        try:
            for _ in call:
                if not drain.is_set():
                    time.sleep(1.0)
        except grpc.RpcError as err:
            slow_codes.append(err.code())

    slow_threads = [threading.Thread(target=read_slowly, args=(call,), daemon=True) for _, call in stuck[16:]]
    for t in slow_threads:
        t.start()

    normal_outputs: dict[int, list[int]] = {}

    def normal(i: int) -> None:
        with Client(target, timeout=60) as client:
            normal_outputs[i] = [t for d in client.stream([i + 1, 7], max_tokens=200) for t in d.token_ids]

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert normal_outputs == {i: expected_tokens([i + 1, 7], 200) for i in range(16)}

    # every stuck request was aborted: nothing runs, every page is back, no slot is held
    wait_until(lambda: engine.stats().num_pages_used == 0 and server.server.admission.num_in_flight == 0,
               timeout=30)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_generation_tokens_total < 32 * 3000 / 4  # cut off long before their 3000 tokens
    assert server.server.admission.max_stream_backlog <= BUFFER + 1  # the server's memory bound

    # a dead reader that finally reads gets what was buffered, then the clear status
    _, dead = stuck[0]
    with_status = None
    try:
        for _ in dead:
            pass
    except grpc.RpcError as err:
        with_status = err
    assert with_status is not None and with_status.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert with_status.details().startswith("client is not reading")
    drain.set()
    for t in slow_threads:
        t.join(60)
    assert slow_codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 16
    for channel, _ in stuck:
        channel.close()
    with Client(target) as client:
        assert client.health() == "SERVING"
        assert client.stats().num_in_flight == 0
