"""A lone stream served over HTTP, hop by hop: the client's TTFT and inter-token latencies, and the
server's own step trace (`--trace-file`): how long a decode step takes on the device, and how long the
device waits between two steps (the engine loop, the sampler's call, the HTTP edge: whatever is not
the step). One request at a time, 512 prompt / 128 output tokens, EOS ignored, and by default no
temperature sent: the server's default (1.0, the OpenAI API's), as `vllm bench serve` sends it.

    .venv/bin/python -P benchmarks/lone_stream.py --model /tmp/vsv/models/30m --rounds 2
    .venv/bin/python -P benchmarks/lone_stream.py --model /tmp/vsv/models/30m --rounds 2 --every-row

`--every-row` alternates this checkout with itself forced to draw every one of max_num_seqs rows in its
plain sampler program (`sampler_rows` -> max_num_seqs, the four programs of before the row rungs): the
A/B of that change, each round a fresh server of each, in alternating order.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = """import sys
if {every_row}:  # the plain sampler on every row, as before the row rungs
    import jaxcpp.runtime.stage as stage
    stage.sampler_rows = lambda n, m: m
    stage.sampler_programs = lambda m: [(h, k, m) for h in (False, True) for k in (False, True)]
from jaxcpp.serving.cli import main
sys.argv[0] = "jaxcpp"
sys.exit(main())
"""


def serve(args: argparse.Namespace, port: int, every_row: bool, trace: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", LAUNCH.format(every_row=every_row), "serve", "--model", args.model,
           "--served-model-name", "m", "--no-enable-grpc", "--http-port", str(port), "--log-stats-interval-s", "0",
           "--kv-cache-memory-gb", "2", "--max-model-len", "1280", "--max-num-batched-tokens", "512",
           "--max-num-seqs", "64", "--dtype", "float32", "--trace-file", str(trace)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline and "jaxcpp: serving" not in log.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; its log: {log}")
        time.sleep(1)
    return proc


def stream(port: int, prompt: list[int], args: argparse.Namespace) -> list[float]:
    """One streamed completion: the arrival time of each of its events, the request's send first."""
    body = {"model": "m", "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True, "stream": True}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = [time.perf_counter()]
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response, buf = conn.getresponse(), b""
    while chunk := response.read1(65536):
        now, buf = time.perf_counter(), buf + chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: {"):
                times.append(now)
    conn.close()
    return times


def step_trace(trace: Path) -> tuple[float, float]:
    """Median decode step on the device (ms) and median wait of the device between two decode steps."""
    text = trace.read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    steps = sorted((e for e in events if e.get("cat") == "forward" and e["args"]["num_tokens_padded"] < 64),
                   key=lambda e: e["ts"])
    pairs = zip(steps, steps[1:], strict=False)
    gaps = [b["ts"] - a["ts"] - a["dur"] for a, b in pairs if b["args"]["step"] == a["args"]["step"] + 1]
    return statistics.median(e["dur"] for e in steps) / 1e3, statistics.median(gaps) / 1e3


def one_round(args: argparse.Namespace, every_row: bool, seed: int, work: Path) -> dict[str, float]:
    from jaxcpp.head.supervision import free_port

    port, name = free_port(), "every-row" if every_row else "this"
    trace = work / f"trace-{name}-{seed}.json"
    proc = serve(args, port, every_row, trace, work / f"server-{name}-{seed}.log")
    try:
        rng = random.Random(seed)
        prompts = [[rng.randrange(10, 4000) for _ in range(args.input_len)] for _ in range(args.requests + 1)]
        stream(port, prompts[0], args)  # warm-up
        ttft, itl, tput = [], [], []
        for prompt in prompts[1:]:
            times = stream(port, prompt, args)
            ttft.append(times[1] - times[0])
            itl += [b - a for a, b in zip(times[1:], times[2:], strict=False)]
            tput.append((len(times) - 1) / (times[-1] - times[0]))
    finally:
        proc.terminate()
        proc.wait(60)
    step_ms, gap_ms = step_trace(trace)
    return {"ttft_ms": statistics.median(ttft) * 1e3, "itl_ms": statistics.median(itl) * 1e3,
            "tok_s": statistics.median(tput), "step_ms": step_ms, "gap_ms": gap_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=4, help="timed requests a round (after one warm-up)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="sent with each request (default: not sent)")
    p.add_argument("--every-row", action="store_true", help="A/B against the plain sampler on every row")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lone-stream-"))
    rows: list[tuple[int, str, float, dict[str, float]]] = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for every_row in order if args.every_row else [False]:
            res = one_round(args, every_row, r, work)
            load = float(Path("/proc/loadavg").read_text().split()[0])
            rows.append((r + 1, "every row" if every_row else "this checkout", load, res))
            figures = "  ".join(f"{k} {v:.2f}" for k, v in res.items())
            print(f"round {r + 1} {rows[-1][1]:13} load {load:4.1f}: {figures}", flush=True)
    for name in dict.fromkeys(row[1] for row in rows):
        mine = [row[3] for row in rows if row[1] == name]
        print(f"median {name:13}: " + "  ".join(f"{k} {statistics.median(m[k] for m in mine):.2f}" for k in mine[0]))
    print(f"traces and server logs: {work}")


if __name__ == "__main__":
    main()
