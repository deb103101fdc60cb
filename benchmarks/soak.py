"""Soak test: N minutes of mixed, partly hostile load on a real `jaxcpp serve`, watching for leaks.

Starts `jaxcpp serve` (or attaches to `--target` with `--pid`), then keeps `--concurrency` clients busy
until the time is up. Each client picks, per request: a normal stream (random prompt and output
length, greedy or sampled), a cancel (dropped after a random number of tokens), a short deadline, or a
bad request (empty prompt, NaN temperature, out-of-vocab id, too long a prompt, undecodable bytes).
Every `--sample-interval-s` it records the server's RSS (/proc/PID/status), pages in use, running,
waiting, calls in flight and the outcome counts. At the end it waits for the server to go idle,
checks every page is free, sends SIGTERM and checks exit code 0.

Outcomes are sorted into expected (OK; CANCELLED for cancels; DEADLINE_EXCEEDED or OK for deadlines;
INVALID_ARGUMENT for bad requests) and unexpected (anything else). Exits 1 on any unexpected outcome,
any leaked page or a non-zero server exit; writes `<out>/soak.json` and `<out>/soak.png` (RSS and
pages over time). RSS growth is measured from the first sample after the warm-up (`--warmup-s`).

    python benchmarks/soak.py --minutes 1 --out /tmp/soak                 # the CI run
    nice -n 10 python benchmarks/soak.py --minutes 30 --out docs/img     # the published run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from jaxcpp.serving.client import AsyncClient

KINDS = ("normal", "cancel", "deadline", "bad")
EXPECTED = {"normal": {"OK"}, "cancel": {"OK", "CANCELLED"}, "deadline": {"OK", "DEADLINE_EXCEEDED"},
            "bad": {"INVALID_ARGUMENT"}}
SERVE_ARGS = ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--max-num-seqs", "32",
              "--num-pages", "640", "--log-stats-interval-s", "0", "--log-level", "warning",
              "--shutdown-grace-s", "10"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--model", default="tiny")
    p.add_argument("--serve-args", default=" ".join(SERVE_ARGS), help="extra `jaxcpp serve` flags")
    p.add_argument("--target", default=None, help="attach to a running server instead (needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="the attached server's pid, for its RSS")
    p.add_argument("--sample-interval-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: 10%% of the run, at most 120 s")
    p.add_argument("--mix", default="normal=0.7,cancel=0.1,deadline=0.1,bad=0.1")
    p.add_argument("--max-rss-growth-pct", type=float, default=None, help="also fail above this growth")
    p.add_argument("--out", default="soak-out")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class Soak:
    def __init__(self, args: argparse.Namespace, target: str, pid: int, vocab: int) -> None:
        self.args, self.target, self.pid, self.vocab = args, target, pid, vocab
        self.counts: Counter[str] = Counter()        # "kind CODE"
        self.samples: list[dict[str, Any]] = []
        self.tokens = 0
        self.weights = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
        self.t0 = time.monotonic()
        self.load_end = math.inf  # seconds after t0 when the clients stopped

    def outcome(self, kind: str, code: str) -> None:
        self.counts[f"{kind} {code}"] += 1

    async def worker(self, client: AsyncClient, rng: random.Random, end: float) -> None:
        while time.monotonic() < end:
            kind = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
            try:
                await getattr(self, f"_{kind}")(client, rng)
            except grpc.RpcError as err:  # jaxcpp.serving.ClientError, or grpc's own from raw stubs
                self.outcome(kind, err.code().name)
            except Exception as exc:  # noqa: BLE001 - a client-side surprise is an unexpected outcome too
                self.outcome(kind, f"client error {type(exc).__name__}")

    def _prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(0, 256) for _ in range(rng.choice([8, 16, 32, 64, 128, 256, 300]))]

    def _sampling(self, rng: random.Random) -> dict[str, Any]:
        out = dict(max_tokens=rng.choice([4, 16, 32, 64, 128]), ignore_eos=rng.random() < 0.5)
        return out | (dict(temperature=0.0) if rng.random() < 0.5 else dict(temperature=0.8, top_p=0.9))

    async def _normal(self, client: AsyncClient, rng: random.Random) -> None:
        n = 0
        async for delta in client.stream(self._prompt(rng), **self._sampling(rng)):
            n += len(delta.token_ids)
        self.tokens += n
        self.outcome("normal", "OK")

    async def _cancel(self, client: AsyncClient, rng: random.Random) -> None:
        stream = client.stream(self._prompt(rng), **self._sampling(rng))
        stop_after = rng.randint(0, 8)
        async for _ in stream:
            if stop_after == 0:
                break
            stop_after -= 1
        await stream.aclose()  # cancels the call if it is still running
        self.outcome("cancel", "CANCELLED" if stop_after == 0 else "OK")

    async def _deadline(self, client: AsyncClient, rng: random.Random) -> None:
        async for _ in client.stream(self._prompt(rng), timeout=rng.uniform(0.01, 1.0), **self._sampling(rng)):
            pass
        self.outcome("deadline", "OK")

    async def _bad(self, client: AsyncClient, rng: random.Random) -> None:
        case = rng.randrange(6)
        if case == 5:  # bytes that are no protobuf message
            method = client.channel.unary_stream("/jaxcpp.v1.JaxcppService/Generate", request_serializer=None,
                                                 response_deserializer=None)
            async for _ in method(b"\xff\xff\xff" + rng.randbytes(8), timeout=30):
                pass
        else:
            prompt, sampling = [
                ([], {}), ([1, 2], dict(temperature=math.nan)), ([self.vocab + 5], {}),
                ([7] * 600, dict(max_tokens=1)), ([1], dict(max_tokens=0)),
            ][case]
            async for _ in client.stream(prompt, **sampling):
                pass
        self.outcome("bad", "OK")

    async def sampler(self, client: AsyncClient, end: float) -> None:
        while True:
            await self.sample(client)
            if time.monotonic() >= end:
                return
            await asyncio.sleep(self.args.sample_interval_s)

    async def sample(self, client: AsyncClient) -> dict[str, Any]:
        stats = await client.stats()
        row = dict(t=round(time.monotonic() - self.t0, 2), rss_mib=round(rss_mib(self.pid), 1),
                   pages_used=stats.engine.num_pages_used, pages_total=stats.engine.num_pages_total,
                   running=stats.engine.num_running, waiting=stats.engine.num_waiting,
                   in_flight=stats.num_in_flight, preemptions=stats.engine.num_preemptions_total,
                   compilations=stats.engine.num_compilations_since_warmup,
                   unexpected=self.num_unexpected(), requests=sum(self.counts.values()))
        self.samples.append(row)
        return row

    def num_unexpected(self) -> int:
        return sum(n for key, n in self.counts.items() if key.split(" ", 1)[1] not in EXPECTED[key.split()[0]])


async def run(args: argparse.Namespace, target: str, pid: int) -> Soak:
    async with AsyncClient(target, timeout=120) as client:
        await client.wait_ready(60)
        info = await client.model_info()
        soak = Soak(args, target, pid, info.vocab_size)
        end = time.monotonic() + args.minutes * 60
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
        await asyncio.gather(soak.sampler(client, end), *(soak.worker(client, r, end) for r in rngs))
        soak.load_end = time.monotonic() - soak.t0
        for _ in range(300):  # idle: every call answered, every page back
            row = await soak.sample(client)
            if row["in_flight"] == 0 and row["pages_used"] == 0 and row["running"] == 0:
                break
            await asyncio.sleep(0.1)
    return soak


def report(soak: Soak, args: argparse.Namespace, exit_code: int | None) -> dict[str, Any]:
    warmup = args.warmup_s if args.warmup_s is not None else min(120.0, args.minutes * 6)
    # RSS compared under load: the first sample after the warm-up against the last before the clients stop
    loaded = [s for s in soak.samples if s["t"] <= soak.load_end]
    after = [s for s in loaded if s["t"] >= warmup] or loaded
    rss_warm, rss_last = after[0]["rss_mib"], after[-1]["rss_mib"]
    rss_peak = max(s["rss_mib"] for s in after)
    by_code: Counter[str] = Counter()
    for key, n in soak.counts.items():
        by_code[key.split(" ", 1)[1]] += n
    final = soak.samples[-1]
    return dict(
        minutes=args.minutes, concurrency=args.concurrency, mix=soak.weights,
        requests=sum(soak.counts.values()), served_ok=soak.counts["normal OK"], tokens_streamed=soak.tokens,
        outcomes=dict(sorted(soak.counts.items())), by_code=dict(sorted(by_code.items())),
        unexpected=soak.num_unexpected(), pages_leaked=final["pages_used"], in_flight_at_end=final["in_flight"],
        preemptions=final["preemptions"], compilations_since_warmup=final["compilations"],
        rss_mib=dict(warm=rss_warm, last=rss_last, peak_after_warmup=rss_peak, idle_at_end=final["rss_mib"],
                     growth_pct=round(100 * (rss_last - rss_warm) / rss_warm, 2),
                     peak_growth_pct=round(100 * (rss_peak - rss_warm) / rss_warm, 2)),
        warmup_s=warmup, server_exit_code=exit_code, samples=soak.samples)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in result["samples"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [s["rss_mib"] for s in result["samples"]], color="tab:blue", label="server RSS (MiB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    ax.axvline(result["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    ax2 = ax.twinx()
    ax2.plot(t, [s["pages_used"] for s in result["samples"]], color="tab:orange", alpha=0.8,
             label="KV pages in use")
    ax2.set_ylabel(f"KV pages in use (of {result['samples'][0]['pages_total']})", color="tab:orange")
    ax.set_title(f"soak: {result['minutes']:g} min at concurrency {result['concurrency']}, "
                 f"{result['requests']} requests, {result['unexpected']} unexpected, "
                 f"{result['pages_leaked']} pages leaked")
    fig.legend(loc="upper right", bbox_to_anchor=(0.9, 0.88), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.target is None:
        cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", args.model, "--port", "0",
               "--http-port", "0", *args.serve_args.split()]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("jaxcpp: serving"):
            raise SystemExit(f"server did not start (exit {proc.wait()}): {' '.join(cmd)}")
        target, pid = line.split(" on ")[1].split()[0], proc.pid
    else:
        if args.pid is None:
            raise SystemExit("--target needs --pid (for the server's RSS)")
        target, pid = args.target, args.pid
    exit_code = None
    try:
        soak = asyncio.run(run(args, target, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_code = proc.wait(120)
    result = report(soak, args, exit_code)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "soak.png")
    summary = {k: result[k] for k in ("requests", "served_ok", "by_code", "unexpected", "pages_leaked",
                                      "rss_mib", "preemptions", "compilations_since_warmup", "server_exit_code")}
    print(json.dumps(summary, indent=1))
    failed = result["unexpected"] or result["pages_leaked"] or result["in_flight_at_end"] or exit_code not in (0, None)
    if args.max_rss_growth_pct is not None and result["rss_mib"]["growth_pct"] > args.max_rss_growth_pct:
        failed = True
    if failed:
        print(f"soak: FAILED ({out / 'soak.json'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
