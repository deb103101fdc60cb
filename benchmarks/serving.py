"""Serving benchmark for a jaxcpp gRPC server, in the manner of vLLM's benchmark_serving.

`run`: requests arrive as a Poisson process (or Gamma with `--burstiness`) at `--request-rate`, at
most `--max-concurrency` in flight; prompts are random token ids of `--random-input-len` (±range
ratio) or come from a JSONL dataset ({"prompt": str | [ids], "output_len": int}); every request
streams `output_len` tokens (ignore_eos). Optionally a long prompt is injected at fixed times
(`--inject-long-prompt N --inject-every S`): the chunked-prefill ITL study of Sarathi-Serve
(docs/benchmarks.md). Reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p99 and
--percentiles), request and token throughput, goodput under `--goodput` SLOs; `--result-file`
writes all of it, with per-request token timestamps, as JSON.

`sweep`: starts one `jaxcpp serve` per configuration (chunking off, then each
`--max-num-batched-tokens`), runs the same workload against each (`--repeat` times, alternating, the
table giving medians), and writes the markdown table and the ITL-over-time plot.

`run --backend openai --target http://HOST:PORT/v1` measures the OpenAI-compatible HTTP API instead
(streamed /v1/completions, read as raw server-sent events, so no client library's parsing is timed).

`frontends`: gRPC and HTTP side by side: one local `jaxcpp serve` with both front ends on one engine,
the same workload through each in turn (`--rounds` times, alternating), at each `--concurrencies`
level; reports TTFT and ITL medians and p99 per front end, the HTTP/gRPC ratio of median ITL, and each
front end's time to first token against the engine's own TTFT (the mean of the server's
jaxcpp_time_to_first_token_seconds histogram over the same requests): the front end's cost.

`prefix`: prefix caching on and off, one local server each, the same two workloads against both:
(a) `--num-prompts` requests sharing a `--shared-prefix-len` system prompt, each with its own
`--random-input-len` suffix; (b) `--num-conversations` multi-turn chats of `--num-turns` turns, each
turn resending the whole history (earlier user turns of `--turn-input-len` tokens and the model's
replies) plus a new user turn. Reports TTFT, throughput and the prefix-cache hit rate (the server's
hit / queried tokens over the workload) as a markdown table.

    python benchmarks/serving.py run --target 127.0.0.1:50051 --num-prompts 200 --request-rate 8
    python benchmarks/serving.py run --backend openai --target http://127.0.0.1:8000/v1 --num-prompts 200
    python benchmarks/serving.py frontends --concurrencies 1,32 --rounds 3 --out frontends.md
    python benchmarks/serving.py sweep --budgets 64,128,256 --out sweep.md
    python benchmarks/serving.py prefix --serve-args "--model tiny --max-model-len 2048" --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxcpp.runtime.stage_setup import pin_to_cores
from jaxcpp.serving.client import AsyncClient


@dataclass
class RequestSpec:
    prompt: str | list[int]
    output_len: int
    kind: str = "normal"          # "normal" or "long" (an injected long prompt)
    send_at: float | None = None  # fixed send time (s after start) for injected requests


@dataclass
class RequestResult:
    kind: str
    prompt_len: int
    start: float                  # seconds after the benchmark started
    success: bool = False
    error: str = ""
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of each token-carrying message
    cached_tokens: int = 0        # prompt tokens the server's prefix cache supplied
    server_ttft: float = 0.0      # the engine's own TTFT (from admission), from the last message
    token_ids: list[int] = field(default_factory=list, repr=False)  # the output (multi-turn resends it)

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


# -- workload ------------------------------------------------------------------------------------
def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab: list[int],
                    rng: random.Random) -> list[RequestSpec]:
    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    return [RequestSpec([rng.choice(vocab) for _ in range(length(input_len))], length(output_len))
            for _ in range(n)]


def dataset_requests(path: str, n: int, default_output_len: int) -> list[RequestSpec]:
    specs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                specs.append(RequestSpec(row["prompt"], int(row.get("output_len", default_output_len))))
    if not specs:
        raise SystemExit(f"{path}: no requests")
    return [specs[i % len(specs)] for i in range(n)]


def shared_prefix_requests(n: int, prefix_len: int, suffix_len: int, output_len: int, vocab: list[int],
                           rng: random.Random) -> list[RequestSpec]:
    """n prompts: one system prompt of `prefix_len` tokens, then a suffix of `suffix_len` of their own."""
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]
    return [RequestSpec(prefix + [rng.choice(vocab) for _ in range(suffix_len)], output_len) for _ in range(n)]


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Gaps between sends: Gamma(shape=burstiness, mean 1/rate); burstiness 1 is a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


# -- running -------------------------------------------------------------------------------------
async def _one(client: AsyncClient, spec: RequestSpec, t0: float) -> RequestResult:
    prompt_len = len(spec.prompt) if isinstance(spec.prompt, list) else 0
    start = time.perf_counter()
    res = RequestResult(spec.kind, prompt_len, start - t0)
    last = start
    try:
        async for delta in client.stream(spec.prompt, max_tokens=spec.output_len, temperature=0.0,
                                         ignore_eos=True):
            now = time.perf_counter()
            if delta.token_ids:
                if res.output_len == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                res.token_times.append(now - t0)
                res.output_len += len(delta.token_ids)
                last = now
            res.token_ids += delta.token_ids
            if delta.finish_reason is not None:
                res.prompt_len = delta.num_prompt_tokens
                res.cached_tokens = delta.num_cached_tokens
                res.server_ttft = delta.ttft_s
        res.e2el = time.perf_counter() - start
        res.success = True
    except Exception as exc:  # a failed request is reported, not fatal
        res.error = repr(exc)
    return res


async def _one_openai(http: Any, url: str, model: str, spec: RequestSpec, t0: float) -> RequestResult:
    """One streamed /v1/completions request, timed on the raw server-sent events: each event that
    carries a choice is one engine step's output (the server sends one per step with new tokens)."""
    prompt_len = len(spec.prompt) if isinstance(spec.prompt, list) else 0
    start = time.perf_counter()
    res = RequestResult(spec.kind, prompt_len, start - t0)
    last = start
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", url + "/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if event.get("choices"):
                    if res.output_len == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    res.token_times.append(now - t0)
                    res.output_len += 1
                    last = now
                elif event.get("usage"):
                    res.prompt_len = event["usage"]["prompt_tokens"]
                    res.output_len = event["usage"]["completion_tokens"]
        res.e2el = time.perf_counter() - start
        res.success = True
    except Exception as exc:  # a failed request is reported, not fatal
        res.error = repr(exc)
    return res


def _http_client(api_key: str | None) -> Any:
    """An async HTTP client (httpx, or httpx2, which the openai package brings) with room for every stream."""
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx  # type: ignore[no-redef]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(headers=headers, timeout=None, limits=httpx.Limits(max_connections=1024))


async def _openai_model(url: str, api_key: str | None) -> str:
    async with _http_client(api_key) as http:
        for _ in range(300):
            try:
                return str((await http.get(url + "/models")).json()["data"][0]["id"])
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.1)
    raise SystemExit(f"{url}: no model list")


async def run_workload(target: str, specs: list[RequestSpec], gaps: list[float], max_concurrency: int | None,
                       api_key: str | None = None, backend: str = "grpc") -> tuple[list[RequestResult], float]:
    if backend == "openai":
        model = await _openai_model(target, api_key)
        async with _http_client(api_key) as http:
            return await _drive(lambda spec, t0: _one_openai(http, target, model, spec, t0), specs, gaps,
                                max_concurrency)
    async with AsyncClient(target, api_key=api_key) as client:
        await client.wait_ready(30)
        return await _drive(lambda spec, t0: _one(client, spec, t0), specs, gaps, max_concurrency)


async def _drive(one: Any, specs: list[RequestSpec], gaps: list[float],
                 max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    """Send `specs` at their arrival gaps (injected ones at their own times), at most `max_concurrency` at once."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def limited(spec: RequestSpec) -> RequestResult:
        if sem is None:
            return await one(spec, t0)
        async with sem:
            return await one(spec, t0)

    async def at(spec: RequestSpec) -> RequestResult:  # injected: fixed time, outside the limit
        assert spec.send_at is not None
        await asyncio.sleep(max(0.0, t0 + spec.send_at - time.perf_counter()))
        return await one(spec, t0)

    tasks = [asyncio.create_task(at(s)) for s in specs if s.send_at is not None]
    for spec, gap in zip([s for s in specs if s.send_at is None], gaps, strict=False):
        tasks.append(asyncio.create_task(limited(spec)))
        await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def run_conversations(target: str, num_conversations: int, num_turns: int, turn_len: int, output_len: int,
                            vocab: list[int], rng: random.Random,
                            api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Concurrent chats; each turn waits for the previous reply and resends the whole history with it."""
    turns = [[[rng.choice(vocab) for _ in range(turn_len)] for _ in range(num_turns)]
             for _ in range(num_conversations)]
    async with AsyncClient(target, api_key=api_key) as client:
        await client.wait_ready(30)
        t0 = time.perf_counter()

        async def chat(user_turns: list[list[int]]) -> list[RequestResult]:
            history: list[int] = []
            results = []
            for user in user_turns:
                history += user
                res = await _one(client, RequestSpec(list(history), output_len), t0)
                results.append(res)
                if not res.success:
                    break
                history += res.token_ids
            return results

        chats = await asyncio.gather(*(chat(c) for c in turns))
        return [r for c in chats for r in c], time.perf_counter() - t0


async def _prefix_counters(target: str, api_key: str | None) -> tuple[int, int]:
    async with AsyncClient(target, api_key=api_key) as client:
        e = (await client.stats()).engine
        return e.num_prefix_cache_queried_tokens_total, e.num_prefix_cache_hit_tokens_total


# -- reporting -----------------------------------------------------------------------------------
def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "max": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    arr = np.asarray(values) * 1e3  # milliseconds
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "max": float(arr.max())}
    out.update({f"p{p:g}": float(np.percentile(arr, p)) for p in percentiles})
    return out


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> SLOs in ms; keys ttft, tpot, e2el."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    normal = [r for r in ok if r.kind == "normal"]
    long = [r for r in ok if r.kind == "long"]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = [r for r in ok if all(getattr(r, k) * 1e3 <= v for k, v in slos.items())]
    return {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput_slos_ms": slos, "request_goodput": len(good) / duration if slos else None,
        # Latencies of the ordinary requests; the injected long prompts are reported on their own.
        "ttft_ms": _stats([r.ttft for r in normal], percentiles),
        "tpot_ms": _stats([r.tpot for r in normal if r.output_len > 1], percentiles),
        "itl_ms": _stats([g for r in normal for g in r.itl], percentiles),
        "e2el_ms": _stats([r.e2el for r in normal], percentiles),
        "long_prompt_ttft_ms": _stats([r.ttft for r in long], percentiles) if long else None,
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"{'completed / failed':<32}{s['completed']} / {s['failed']}")
    print(f"{'duration (s)':<32}{s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<32}{s['request_throughput']:.2f}")
    print(f"{'output token throughput (tok/s)':<32}{s['output_throughput']:.1f}")
    print(f"{'total token throughput (tok/s)':<32}{s['total_token_throughput']:.1f}")
    if s["request_goodput"] is not None:
        print(f"{'request goodput (req/s)':<32}{s['request_goodput']:.2f}  SLOs {s['goodput_slos_ms']}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "long_prompt_ttft_ms"):
        if s[key] is not None:
            print(f"{key:<32}" + "  ".join(f"{k} {v:.1f}" for k, v in s[key].items()))
    for error in s["errors"]:
        print(f"error: {error}")


# -- commands ------------------------------------------------------------------------------------
def build_workload(args: argparse.Namespace, vocab_size: int,
                   eos: set[int]) -> tuple[list[RequestSpec], list[float]]:
    rng = random.Random(args.seed)
    vocab = [t for t in range(vocab_size) if t not in eos]
    if args.dataset:
        specs = dataset_requests(args.dataset, args.num_prompts, args.random_output_len)
    else:
        specs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                args.random_range_ratio, vocab, rng)
    gaps = arrival_gaps(len(specs), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    if args.inject_long_prompt:
        t = args.inject_at
        while t < args.inject_until:
            specs.append(RequestSpec([rng.choice(vocab) for _ in range(args.inject_long_prompt)],
                                     args.inject_output_len, kind="long", send_at=t))
            t += args.inject_every if args.inject_every > 0 else math.inf
    return specs, gaps


async def _model_vocab(target: str, api_key: str | None) -> tuple[int, set[int]]:
    async with AsyncClient(target, api_key=api_key) as client:
        await client.wait_ready(60)
        info = await client.model_info()
        return info.vocab_size, set(info.eos_token_ids)


def run_once(args: argparse.Namespace, target: str, vocab_target: str | None = None) -> dict[str, Any]:
    """`vocab_target`: a gRPC address to read the vocabulary from (the openai backend's --vocab-size else)."""
    backend = getattr(args, "backend", "grpc")
    if backend == "openai" and vocab_target is None:
        vocab_size, eos = args.vocab_size, set()
    else:
        vocab_size, eos = asyncio.run(_model_vocab(vocab_target or target, args.api_key))
    specs, gaps = build_workload(args, vocab_size, eos)
    results, duration = asyncio.run(run_workload(target, specs, gaps, args.max_concurrency, args.api_key,
                                                 backend))
    summary = summarize(results, duration, args.percentiles, parse_goodput(args.goodput))
    return {"config": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary,
            "requests": [asdict(r) for r in results]}


def cmd_run(args: argparse.Namespace) -> int:
    result = run_once(args, args.target)
    print_summary(result["summary"])
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0 if result["summary"]["failed"] == 0 else 1


class LocalServer:
    """`jaxcpp serve` in a subprocess on a free port; stopped with SIGTERM. `cpus`: pinned to these cores.
    `pin_at_exec`: set in the child before exec (as `taskset -c` does), so XLA:CPU sizes its thread pool
    for those cores; by default every thread is pinned once the server is up instead: the pool keeps a
    thread per machine core, and jax's transfer server, which sends on that pool, is not held behind
    the computations (stage processes, whose one thread waits for each forward anyway, run forwards
    inline instead: `jaxcpp.runtime.stage_setup.run_forwards_inline_on_cores`)."""

    def __init__(self, serve_args: list[str], cpus: list[int] | None = None, pin_at_exec: bool = False) -> None:
        cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--port", "0", "--http-port", "0",
               "--log-level", "warning", *serve_args]
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None and pin_at_exec else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("jaxcpp: serving"):
                self.target = line.split(" on ")[1].split()[0]
                self.http_url = next((w for w in line.split() if w.startswith("http")), "")
                if cpus is not None and not pin_at_exec:
                    pin_to_cores(cpus, self.proc.pid)
                return
        raise SystemExit(f"server exited with {self.proc.wait()}: {' '.join(cmd)}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def cmd_sweep(args: argparse.Namespace) -> int:
    configs = [("chunked off", ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                                str(args.unchunked_budget)])]
    configs += [(f"chunked, {b}", ["--max-num-batched-tokens", str(b)]) for b in args.budgets]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for i in range(args.repeat):  # the configurations alternate, so the machine's load falls on all alike
        for name, flags in configs:
            server = LocalServer([*args.serve_args.split(), *flags])
            t = time.time()
            try:
                result = run_once(args, server.target)
            finally:
                server.stop()
            result["name"], result["serve_flags"] = name, flags
            runs[name].append(result)
            s = result["summary"]
            print(f"run {i + 1} {name:<16} p50 ITL {s['itl_ms']['median']:.1f} ms  p99 ITL {s['itl_ms']['p99']:.1f} "
                  f"ms  max ITL {s['itl_ms']['max']:.0f} ms  ({time.time() - t:.0f}s)", flush=True)
    rows = [median_row(rs) for rs in runs.values()]
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(rows, indent=1))
    print(sweep_table(rows) + (f"\n\nmedians of {args.repeat} runs per configuration" if args.repeat > 1 else ""))
    for row in rows:
        print(f"{row['name']}: max ITL of each run " + ", ".join(f"{r['itl_ms']['max']:.0f}" for r in row["runs"])
              + " ms")
    if args.plot:
        plot_itl_over_time(rows, args.plot)
    return 0


def cmd_frontends(args: argparse.Namespace) -> int:
    """gRPC and HTTP in turn against one server, `--rounds` times per concurrency level."""
    server = LocalServer(args.serve_args.split())
    rows = []
    try:
        for concurrency in args.concurrencies:
            pooled: dict[str, list[dict[str, Any]]] = {"grpc": [], "openai": []}
            engine_ttft: dict[str, list[float]] = {"grpc": [], "openai": []}
            tput: dict[str, list[float]] = {"grpc": [], "openai": []}
            for _ in range(args.rounds):
                for backend in ("grpc", "openai"):
                    run_args = argparse.Namespace(**{**vars(args), "backend": backend,
                                                     "max_concurrency": concurrency,
                                                     "num_prompts": args.prompts_per_client * concurrency})
                    before = _engine_ttft(server.http_url)
                    result = run_once(run_args, server.http_url if backend == "openai" else server.target,
                                      vocab_target=server.target)
                    after = _engine_ttft(server.http_url)
                    engine_ttft[backend].append((after[0] - before[0]) / max(after[1] - before[1], 1))
                    pooled[backend] += result["requests"]
                    tput[backend].append(result["summary"]["output_throughput"])
                    print(f"c={concurrency} {backend:<6} ITL p50 {result['summary']['itl_ms']['median']:.2f} ms  "
                          f"TTFT p50 {result['summary']['ttft_ms']['median']:.1f} ms  "
                          f"{result['summary']['output_throughput']:.0f} tok/s", flush=True)
            for backend, requests in pooled.items():
                summary = summarize([RequestResult(**r) for r in requests], 1.0, [99], {})
                rows.append({"concurrency": concurrency, "backend": backend, "summary": summary,
                             "engine_ttft_ms": 1e3 * float(np.mean(engine_ttft[backend])),
                             "output_throughput_each": tput[backend],
                             "ttft_ms_each": [round(r["ttft"] * 1e3, 2) for r in requests]})
    finally:
        server.stop()
    table = frontends_table(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(rows, indent=1))
    return 0


def _engine_ttft(http_url: str) -> tuple[float, float]:
    """(sum, count) of the server's own TTFT histogram, from /metrics."""
    import urllib.request

    text = urllib.request.urlopen(http_url.removesuffix("/v1") + "/metrics").read().decode()
    values = {}
    for line in text.splitlines():
        for key in ("jaxcpp_time_to_first_token_seconds_sum", "jaxcpp_time_to_first_token_seconds_count"):
            if line.startswith(key + " "):
                values[key] = float(line.split()[1])
    return values["jaxcpp_time_to_first_token_seconds_sum"], values["jaxcpp_time_to_first_token_seconds_count"]


def frontends_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | front end | TTFT median | TTFT p99 | ITL median | ITL p99 | client TTFT mean | "
             "engine TTFT mean | front-end cost | requests |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['concurrency']} | {'gRPC' if r['backend'] == 'grpc' else 'HTTP (OpenAI)'} | "
                     f"{s['ttft_ms']['median']:.1f} ms | {s['ttft_ms']['p99']:.1f} ms | "
                     f"{s['itl_ms']['median']:.2f} ms | {s['itl_ms']['p99']:.2f} ms | "
                     f"{s['ttft_ms']['mean']:.1f} ms | {r['engine_ttft_ms']:.1f} ms | "
                     f"{s['ttft_ms']['mean'] - r['engine_ttft_ms']:.1f} ms | {s['completed']} |")
    itl = {(r["concurrency"], r["backend"]): r["summary"]["itl_ms"]["median"] for r in rows}
    for c in sorted({r["concurrency"] for r in rows}):
        if itl.get((c, "grpc")):
            lines.append(f"\nconcurrency {c}: HTTP median ITL / gRPC median ITL = "
                         f"{itl[(c, 'openai')] / itl[(c, 'grpc')]:.3f}")
    return "\n".join(lines)


def median_row(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs as one row: every figure of the summary the median over the runs; the
    requests (for the plot) of the run whose p99 ITL is the median."""
    summaries = [r["summary"] for r in results]

    def median(key: str) -> Any:
        values = [s[key] for s in summaries]
        if any(v is None for v in values):
            return None
        if isinstance(values[0], dict):
            return {k: float(np.median([v[k] for v in values])) for k in values[0]}
        if isinstance(values[0], int | float):
            return float(np.median(values))
        return values[0]

    middle = sorted(results, key=lambda r: r["summary"]["itl_ms"]["p99"])[len(results) // 2]
    return {**middle, "summary": {key: median(key) for key in summaries[0]}, "runs": summaries}


def cmd_prefix(args: argparse.Namespace) -> int:
    rows = []
    for name, flag in (("off", "--no-enable-prefix-caching"), ("on", "--enable-prefix-caching")):
        server = LocalServer([*args.serve_args.split(), flag])
        try:
            for workload in ("shared-prefix", "multi-turn"):
                row = run_prefix_workload(args, server.target, workload)
                row["caching"] = name
                rows.append(row)
                s = row["summary"]
                print(f"caching {name:<3} {workload:<13} TTFT p50 {s['ttft_ms']['median']:.0f} ms  "
                      f"hit rate {row['hit_rate']:.1%}", flush=True)
        finally:
            server.stop()
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(rows, indent=1))
    print(prefix_table(rows))
    return 0


def run_prefix_workload(args: argparse.Namespace, target: str, workload: str) -> dict[str, Any]:
    vocab_size, eos = asyncio.run(_model_vocab(target, args.api_key))
    vocab = [t for t in range(vocab_size) if t not in eos]
    # Each workload its own tokens: the chats must not hit the system prompt of the first workload.
    rng = random.Random(f"{args.seed}-{workload}")
    before = asyncio.run(_prefix_counters(target, args.api_key))
    if workload == "shared-prefix":
        specs = shared_prefix_requests(args.num_prompts, args.shared_prefix_len, args.random_input_len,
                                       args.random_output_len, vocab, rng)
        gaps = arrival_gaps(len(specs), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
        results, duration = asyncio.run(run_workload(target, specs, gaps, args.max_concurrency, args.api_key))
    else:
        results, duration = asyncio.run(run_conversations(target, args.num_conversations, args.num_turns,
                                                          args.turn_input_len, args.random_output_len, vocab, rng,
                                                          args.api_key))
    after = asyncio.run(_prefix_counters(target, args.api_key))
    queried, hit = after[0] - before[0], after[1] - before[1]
    summary = summarize(results, duration, args.percentiles, {})
    return {"workload": workload, "summary": summary, "hit_rate": hit / queried if queried else 0.0,
            "queried_tokens": queried, "hit_tokens": hit,
            "cached_tokens_per_request": [r.cached_tokens for r in results],
            "requests": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in results]}


def prefix_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | prefix caching | TTFT median | TTFT p99 | output tok/s | total tok/s | hit rate |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in sorted(rows, key=lambda r: (r["workload"] != "shared-prefix", r["caching"])):
        s = row["summary"]
        lines.append(f"| {row['workload']} | {row['caching']} | {s['ttft_ms']['median']:.0f} ms | "
                     f"{s['ttft_ms']['p99']:.0f} ms | {s['output_throughput']:.0f} | "
                     f"{s['total_token_throughput']:.0f} | {row['hit_rate']:.1%} |")
    by = {(r["workload"], r["caching"]): r["summary"]["ttft_ms"]["median"] for r in rows}
    for workload in ("shared-prefix", "multi-turn"):
        if by.get((workload, "on")) and (workload, "off") in by:
            lines.append(f"\n{workload}: median TTFT {by[(workload, 'off')] / by[(workload, 'on')]:.1f}x lower "
                         "with prefix caching")
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    # The long prompts stall ~1% of the short streams' ITL samples, so p99 sits near that edge; the max
    # shows the stall itself.
    lines = ["| configuration | p50 ITL | p95 ITL | p99 ITL | max ITL | TTFT p95 | long-prompt TTFT | throughput |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        s = row["summary"]
        long = s["long_prompt_ttft_ms"]
        long_ttft = f"{long['mean']:.0f} ms" if long else "-"
        lines.append(f"| {row['name']} | {s['itl_ms']['median']:.1f} ms | {s['itl_ms']['p95']:.1f} ms | "
                     f"{s['itl_ms']['p99']:.1f} ms | {s['itl_ms']['max']:.0f} ms | {s['ttft_ms']['p95']:.0f} ms | "
                     f"{long_ttft} | "
                     f"{s['output_throughput']:.0f} tok/s |")
    return "\n".join(lines)


def plot_itl_over_time(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = [rows[0], min(rows[1:], key=lambda r: r["summary"]["itl_ms"]["p99"])] if len(rows) > 1 else rows
    fig, axes = plt.subplots(len(picks), 1, figsize=(9, 2.6 * len(picks)), sharex=True, sharey=True)
    for ax, row in zip(np.atleast_1d(axes), picks, strict=True):
        for req in row["requests"]:
            if req["kind"] == "normal" and req["itl"]:
                ax.scatter(req["token_times"][1:], np.asarray(req["itl"]) * 1e3, s=2, color="tab:blue")
            elif req["kind"] == "long":
                ax.axvline(req["start"], color="tab:red", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{row['name']} (dashed: long prompt sent)", fontsize=10)
    np.atleast_1d(axes)[-1].set_xlabel("time since start (s)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="benchmark a running server")
    run.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port, or the OpenAI API's base URL "
                     "(http://HOST:PORT/v1) with --backend openai")
    run.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    run.add_argument("--vocab-size", type=int, default=256, help="openai backend: random prompt ids below this")
    frontends = sub.add_parser("frontends", help="gRPC vs HTTP side by side on one local server")
    frontends.add_argument("--serve-args", default="--model tiny", help="flags for `jaxcpp serve`")
    frontends.add_argument("--concurrencies", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    frontends.add_argument("--rounds", type=int, default=3, help="alternations of the two front ends")
    frontends.add_argument("--prompts-per-client", type=int, default=4,
                           help="requests per round: this many per concurrent client")
    frontends.add_argument("--out", default=None, help="write the markdown table here")
    sweep = sub.add_parser("sweep", help="chunked-prefill study: one local server per configuration")
    sweep.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    sweep.add_argument("--unchunked-budget", type=int, default=1024,
                       help="--max-num-batched-tokens with chunking off (must hold the long prompt)")
    sweep.add_argument("--serve-args", default="--model tiny", help="flags for every `jaxcpp serve`")
    sweep.add_argument("--plot", default=None, help="write the ITL-over-time PNG here")
    sweep.add_argument("--repeat", type=int, default=1, help="runs per configuration, alternating; the table "
                       "gives medians (single runs are noisy on a shared machine)")
    prefix = sub.add_parser("prefix", help="prefix caching on vs off: shared system prompt and multi-turn chat")
    prefix.add_argument("--serve-args", default="--model tiny", help="flags for both `jaxcpp serve`")
    prefix.add_argument("--shared-prefix-len", type=int, default=1024, help="tokens of the shared system prompt")
    prefix.add_argument("--num-conversations", type=int, default=8)
    prefix.add_argument("--num-turns", type=int, default=4)
    prefix.add_argument("--turn-input-len", type=int, default=128, help="tokens of each new user turn")
    for p in (run, sweep, prefix, frontends):
        p.add_argument("--api-key", default=None)
        p.add_argument("--num-prompts", type=int, default=100)
        p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
        p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 = Poisson")
        p.add_argument("--max-concurrency", type=int, default=None)
        p.add_argument("--dataset", default=None, help='JSONL: {"prompt": str | [ids], "output_len": int}')
        p.add_argument("--random-input-len", type=int, default=64)
        p.add_argument("--random-output-len", type=int, default=64)
        p.add_argument("--random-range-ratio", type=float, default=0.0)
        p.add_argument("--inject-long-prompt", type=int, default=0, help="tokens of an injected long prompt")
        p.add_argument("--inject-output-len", type=int, default=4)
        p.add_argument("--inject-at", type=float, default=2.0, help="first injection, s after start")
        p.add_argument("--inject-every", type=float, default=0.0, help="then every S seconds (0: once)")
        p.add_argument("--inject-until", type=float, default=math.inf)
        p.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms: ttft:500 tpot:50 e2el:5000")
        p.add_argument("--percentiles", type=lambda s: [float(x) for x in s.split(",")], default=[95, 99])
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--result-file", default=None, help="write the JSON results here")
    run.set_defaults(func=cmd_run)
    sweep.set_defaults(func=cmd_sweep)
    prefix.set_defaults(func=cmd_prefix)
    frontends.set_defaults(func=cmd_frontends)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
