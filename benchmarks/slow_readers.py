"""Normal streams' throughput with and without 32 clients that stop reading (16 never read again, 16
read one message a second), on the real tiny engine behind an in-process server.

Each stuck client opens a stream with a 1 KiB HTTP/2 receive window (no BDP growth), as a stuck real
client's full window would look after ~30 messages; the server then queues its outputs until
`--max-stream-buffer`, aborts the request and frees its pages. Until then the stuck streams take
engine steps like any other, so the figure depends on that limit: both are printed.

    python benchmarks/slow_readers.py --max-stream-buffer 256 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import grpc

from jaxcpp.config import ServerConfig
from jaxcpp.serving import Client
from jaxcpp.serving.gen import jaxcpp_pb2 as pb
from jaxcpp.serving.gen import jaxcpp_pb2_grpc as pb_grpc
from jaxcpp.serving.lifecycle import ServerThread

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def normal_throughput(target: str, streams: int, max_tokens: int) -> tuple[float, bool]:
    """(output tokens per second of `streams` greedy streams run together, all complete)."""
    counts: list[int] = []

    def one(i: int) -> None:
        with Client(target, timeout=600) as client:
            deltas = list(client.stream([10 + i, 20, 30, 40], max_tokens=max_tokens, temperature=0,
                                        ignore_eos=True))
            counts.append(deltas[-1].num_generated_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    return sum(counts) / elapsed, counts == [max_tokens] * streams


def start_stuck(target: str, n: int, slow: bool, stop: threading.Event) -> list[grpc.Channel]:
    channels = []
    for i in range(n):
        channel = grpc.insecure_channel(target, options=SMALL_WINDOW)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[50 + i, 60]),
                                     sampling=pb.SamplingParameters(max_tokens=480, ignore_eos=True))
        call = pb_grpc.JaxcppServiceStub(channel).Generate(request, timeout=600)
        next(call)
        if slow:
            def read(call=call) -> None:
                try:
                    for _ in call:
                        if stop.wait(1.0):
                            return
                except grpc.RpcError:
                    pass
            threading.Thread(target=read, daemon=True).start()
        channels.append(channel)
    return channels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-stream-buffer", type=int, nargs="+", default=[256, 32])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="alternate alone/with-stuck runs; medians reported")
    args = p.parse_args()
    from jaxcpp import LLM

    llm = LLM(model="tiny", dtype="float32", max_model_len=512, max_num_batched_tokens=128, max_num_seqs=64,
              num_pages=1024, log_stats_interval_s=0)
    rows = []
    for limit in args.max_stream_buffer:
        with ServerThread(llm.engine, ServerConfig(port=0, http_port=0, max_stream_buffer=limit)) as server:
            target = f"127.0.0.1:{server.port}"
            normal_throughput(target, 4, 16)  # warm the channel and the engine
            alone, beside, complete = [], [], True
            for _ in range(args.repeats):  # alternated, so drifting machine load hits both alike
                rate, ok = normal_throughput(target, args.streams, args.max_tokens)
                alone.append(rate)
                stop = threading.Event()
                stuck = start_stuck(target, 16, False, stop) + start_stuck(target, 16, True, stop)
                rate, ok_beside = normal_throughput(target, args.streams, args.max_tokens)
                beside.append(rate)
                complete = complete and ok and ok_beside
                stop.set()
                for channel in stuck:
                    channel.close()
            backlog = server.server.admission.max_stream_backlog
        a, b = statistics.median(alone), statistics.median(beside)
        rows.append(dict(max_stream_buffer=limit, alone_tok_s=[round(x, 1) for x in alone],
                         with_stuck_tok_s=[round(x, 1) for x in beside], median_ratio=round(b / a, 3),
                         all_complete=complete, max_backlog=backlog))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
