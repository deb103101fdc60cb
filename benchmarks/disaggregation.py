"""Prefill-decode disaggregation against colocated engines on the same cores: the chunked-prefill ITL
study of `benchmarks/serving.py` (decode streams while long prompts arrive) in disaggregated form.

Four `jaxcpp serve` processes of one model with the same flags (`--serve-args`), each pinned to one core:

    colocated       engine A on core 0 and engine B on core 1, both prefilling (chunked) and decoding;
                    the client sends each half the streams and every other long prompt
    disaggregated   a kv_producer on core 0 and a kv_consumer on core 1 (`--prefill-servers` the producer);
                    the client sends the whole workload to the consumer

The workload: `--streams` requests of `--stream-input-len` tokens streaming `--stream-output-len` tokens each
(ignore_eos), all sent at t = 0, and a `--long-prompt-len`-token prompt (`--long-output-len` tokens out) every
`--inject-every` s from `--inject-at` for as long as any stream runs. Each set-up is warmed by one full untimed run,
then the two alternate for `--repeat` timed runs each (run i of both: the same prompts, new ones per run, so
no prefix cache hits); the table gives the medians. ITL is over the streams' messages; throughput is the
streams' output tokens over the time their last token arrived. Per run it also records each server's CPU
seconds (/proc), the rest of the machine's (other sessions), the streams' gaps split by whether a long
prompt was waiting for its first token on their engine, and for the disaggregated pair the consumer's
KV-transfer counts and the producer's own TTFT (its /metrics histogram).

Then one run per set-up of the streams alone (no long prompt): the decode side's own ITL and throughput.

KV transfer: lone prompts of each `--transfer-lens` length, one at a time (`--transfer-repeat` each, after
an untimed one), against the consumer, then against colocated engine A: per request the consumer's stats
deltas (bytes, tokens, pull time offer -> pages arrived, the producer's Generate call) and the producer's
own TTFT, beside the client's TTFT.

Control: `benchmarks/two_core_check.py` alone on core 0, then on cores 0 and 1 at once, before the servers
start and after they stop: do the two cores compute side by side?

    .venv/bin/python benchmarks/disaggregation.py --repeat 3 --out disagg.md --result-file disagg.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from jaxcpp.core.sizing import page_bytes
from jaxcpp.head.supervision import free_port
from jaxcpp.serving.client import AsyncClient, Client

HERE = Path(__file__).resolve().parent
# The random Llama: bigger than the bundled `tiny` (and with room for a 4K prompt), small enough that a
# run takes well under a minute on 2 CPU cores.
RANDOM_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
PRODUCER = '{"kv_role": "kv_producer"}'
CONSUMER = '{"kv_role": "kv_consumer"}'


def _load_serving() -> ModuleType:
    """benchmarks/serving.py, whose workload, driver and summary this reuses (one module, whoever loads it)."""
    name = "benchmark_serving"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "serving.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


serving = _load_serving()


# -- the model ----------------------------------------------------------------------------------
def random_model(folder: Path) -> str:
    """A random Llama (float32, written like the tests' pipeline models), once per folder."""
    if not (folder / "config.json").exists():
        import jax

        from jaxcpp.models.checkpoint import save_hf
        from jaxcpp.models.config import LlamaConfig
        from jaxcpp.models.llama import init_params

        shape = dict(RANDOM_MODEL)
        config = LlamaConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                             eos_token_ids=(1,), bos_token_id=0)
        save_hf(folder, init_params(config, jax.random.key(7)), config)
    return str(folder)


def kv_bytes_per_token(model: str, kv_cache_dtype: str) -> int:
    """What one token's K and V take in the pages, unpadded: 2 x layers x KV heads x head dim x itemsize."""
    path = Path(model) / "config.json"
    if not path.exists():
        raise SystemExit(f"--model {model}: no config.json to read the KV layout from")
    c = json.loads(path.read_text())
    layout = SimpleNamespace(num_key_value_heads=c["num_key_value_heads"],
                             head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return page_bytes(layout, c["num_hidden_layers"], 1, kv_cache_dtype)  # it reads those two fields


# -- the workload -------------------------------------------------------------------------------
def workload(args: argparse.Namespace, vocab_size: int, eos: set[int], seed: int) -> list[Any]:
    """The streams (sent at once) and the long prompts (at fixed times), from serving.py's builder."""
    spec_args = argparse.Namespace(
        dataset=None, num_prompts=args.streams, random_input_len=args.stream_input_len,
        random_output_len=args.stream_output_len, random_range_ratio=0.0, request_rate=float("inf"),
        burstiness=1.0, seed=seed, inject_long_prompt=args.long_prompt_len, inject_output_len=args.long_output_len,
        inject_at=args.inject_at, inject_every=args.inject_every, inject_until=args.inject_until)
    specs, _ = serving.build_workload(spec_args, vocab_size, eos)
    return list(specs)


def split(specs: list[Any], num_targets: int) -> list[int]:
    """The target of each request: the streams dealt out in turn, and the long prompts in turn by send time,
    so each target gets an even share of both."""
    where = [0] * len(specs)
    streams = [i for i, s in enumerate(specs) if s.send_at is None]
    longs = sorted((i for i, s in enumerate(specs) if s.send_at is not None), key=lambda i: specs[i].send_at)
    for group in (streams, longs):
        for n, i in enumerate(group):
            where[i] = n % num_targets
    return where


async def drive(targets: list[str], specs: list[Any], where: list[int],
                before_longs: Callable[[], Any] | None = None) -> tuple[list[Any], list[int], float]:
    """The streams at once, then each long prompt at its time for as long as any stream runs (so long prompts
    arrive at one rate over the streams' whole life, however long a set-up takes); each request to its own
    target, timed by serving.py's `_one` on one clock. `before_longs` runs (in a thread) just before the first
    long prompt is sent. Returns the results, the target of each, the duration."""
    clients = [AsyncClient(t) for t in targets]
    try:
        for c in clients:
            await c.wait_ready(60)
        t0 = time.perf_counter()

        async def one(i: int) -> tuple[Any, int]:
            return await serving._one(clients[where[i]], specs[i], t0), where[i]

        streams = [asyncio.create_task(one(i)) for i, s in enumerate(specs) if s.send_at is None]
        longs: list[asyncio.Task[tuple[Any, int]]] = []
        for i in sorted((i for i, s in enumerate(specs) if s.send_at is not None), key=lambda i: specs[i].send_at):
            await asyncio.wait(streams, timeout=max(0.0, t0 + specs[i].send_at - time.perf_counter()))
            if all(t.done() for t in streams):
                break
            if not longs and before_longs is not None:
                await asyncio.to_thread(before_longs)
            longs.append(asyncio.create_task(one(i)))
        done = await asyncio.gather(*streams, *longs)
        return [r for r, _ in done], [w for _, w in done], time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()


def itl_attribution(results: list[Any], targets: list[int]) -> dict[str, float]:
    """The streams' inter-token gaps split by what their engine was doing: a gap that overlaps a long
    prompt's wait for its first token (sent -> first token) on the same target, and the rest; and the gaps
    in which a long prompt's first token arrived (colocated: its last chunk; disaggregated: its pages'
    import and admission). Milliseconds; counts as numbers of gaps."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for r, w in zip(results, targets, strict=True):
        if r.kind == "long" and r.success and r.output_len:
            windows.setdefault(w, []).append((r.start, r.start + r.ttft))
    during: list[float] = []
    outside: list[float] = []
    admitting: list[float] = []
    for r, w in zip(results, targets, strict=True):
        if r.kind != "normal" or not r.success:
            continue
        for a, b in zip(r.token_times, r.token_times[1:], strict=False):
            mine = windows.get(w, [])
            (during if any(a < end and b > start for start, end in mine) else outside).append(b - a)
            if any(a < end <= b for _, end in mine):
                admitting.append(b - a)

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1e3 if values else 0.0

    return {"during_n": len(during), "during_p50": pct(during, 50), "during_p99": pct(during, 99),
            "outside_n": len(outside), "outside_p50": pct(outside, 50), "outside_p99": pct(outside, 99),
            "admitting_n": len(admitting), "admitting_p50": pct(admitting, 50)}


def summarize(results: list[Any], duration: float) -> dict[str, Any]:
    """serving.py's summary (p50 and p99) plus the streams' throughput: their tokens over the time the last
    one arrived (a long prompt sent after that does not stretch it)."""
    s = serving.summarize(results, duration, [50, 99], {})
    streams = [r for r in results if r.kind == "normal" and r.success]
    end = max((r.token_times[-1] for r in streams if r.token_times), default=0.0)
    s["stream_throughput"] = sum(r.output_len for r in streams) / end if end else 0.0
    s["num_long_prompts"] = sum(r.kind == "long" for r in results)
    return s


# -- servers and their counts -------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_counts(target: str) -> dict[str, int]:
    with Client(target, timeout=30) as c:
        return c.stats().engine.counts()


def engine_ttft(server: Any) -> tuple[float, float]:
    """(sum, count) of the server's own TTFT histogram (admission -> first token)."""
    return serving._engine_ttft(server.http_url)


def delta(after: dict[str, int], before: dict[str, int], keys: tuple[str, ...]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in keys}


TRANSFER_KEYS = ("num_kv_transfers_total", "num_kv_transfer_bytes_total", "num_kv_transfer_tokens_total",
                 "num_kv_transfer_microseconds_total", "num_remote_prefill_microseconds_total",
                 "num_prompt_tokens_total")


class Setups:
    """The four pinned servers; `colocated` and `disaggregated` name the targets a run sends to."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        flags = ["--model", model, *args.serve_args.split()]
        port, pin_at_exec = free_port(), args.pin_at_exec  # the producer's, so the consumer can start beside it
        with ThreadPoolExecutor(4) as pool:  # each compiles on its own core
            a = pool.submit(serving.LocalServer, flags, [0], pin_at_exec)
            b = pool.submit(serving.LocalServer, flags, [1], pin_at_exec)
            self.a, self.b = a.result(), b.result()
            p = pool.submit(serving.LocalServer, [*flags, "--port", str(port), "--kv-transfer-config", PRODUCER], [0],
                            pin_at_exec)
            c = pool.submit(serving.LocalServer, [*flags, "--kv-transfer-config", CONSUMER,
                                                  "--prefill-servers", f"127.0.0.1:{port}"], [1], pin_at_exec)
            self.producer, self.consumer = p.result(), c.result()

    @property
    def all(self) -> dict[str, Any]:
        return {"A": self.a, "B": self.b, "producer": self.producer, "consumer": self.consumer}

    def servers(self, setup: str) -> dict[str, Any]:
        return {"A": self.a, "B": self.b} if setup == "colocated" else \
            {"producer": self.producer, "consumer": self.consumer}

    def targets(self, setup: str) -> list[str]:
        return [self.a.target, self.b.target] if setup == "colocated" else [self.consumer.target]

    def stop(self) -> None:
        for server in self.all.values():
            server.stop()


def run_setup(setups: Setups, setup: str, args: argparse.Namespace, vocab: tuple[int, set[int]],
              seed: int) -> dict[str, Any]:
    specs = workload(args, vocab[0], vocab[1], seed)
    targets = setups.targets(setup)
    where = split(specs, len(targets))
    cpu0 = {name: cpu_seconds(s.proc.pid) for name, s in setups.all.items()}
    client0 = _client_cpu()
    counts0 = engine_counts(setups.consumer.target) if setup == "disaggregated" else None
    ttft0 = engine_ttft(setups.producer) if setup == "disaggregated" else None
    machine0 = machine_cpu()
    at_longs: dict[str, Any] = {}

    def snapshot() -> None:  # the streams' own transfers are done by then: what follows is the long prompts'
        at_longs["counts"], at_longs["ttft"] = engine_counts(setups.consumer.target), engine_ttft(setups.producer)

    results, sent_to, duration = asyncio.run(drive(targets, specs, where,
                                                   snapshot if setup == "disaggregated" else None))
    machine1 = machine_cpu()
    cpu = {name: cpu_seconds(s.proc.pid) - cpu0[name] for name, s in setups.all.items()}
    client = _client_cpu() - client0
    row: dict[str, Any] = {"setup": setup, "seed": seed, "summary": summarize(results, duration), "cpu_s": cpu,
                           "client_cpu_s": client, "itl_split": itl_attribution(results, sent_to),
                           # busy CPU time of everything else on the machine (other sessions), and steal
                           "others_cpu_s": machine1[0] - machine0[0] - sum(cpu.values()) - client,
                           "steal_s": machine1[1] - machine0[1], "loadavg_1m": os.getloadavg()[0],
                           "requests_per_target": [sent_to.count(i) for i in range(len(targets))]}
    if counts0 is not None and ttft0 is not None:
        counts1, ttft1 = engine_counts(setups.consumer.target), engine_ttft(setups.producer)
        row["consumer"] = delta(counts1, counts0, TRANSFER_KEYS)
        row["producer_ttft_mean_ms"] = 1e3 * (ttft1[0] - ttft0[0]) / max(ttft1[1] - ttft0[1], 1)
        if at_longs:
            row["long_prompts"] = long_prompt_times(results, delta(counts1, at_longs["counts"], TRANSFER_KEYS),
                                                    (ttft1[0] - at_longs["ttft"][0], ttft1[1] - at_longs["ttft"][1]))
    return row


def long_prompt_times(results: list[Any], counts: dict[str, int], producer_ttft: tuple[float, float]
                      ) -> dict[str, float]:
    """Where a long prompt's TTFT goes under disaggregation, means in ms over the long prompts of a run: the
    producer's own TTFT (its queue, prefill, first token), its whole Generate call as the consumer saw it
    (plus gathering and offering the pages, and gRPC), the pull (offer -> pages arrived), and the rest:
    the consumer's part (reserving pages before the call; importing the pages, admitting the request and
    sending its first token after the pull)."""
    longs = [r for r in results if r.kind == "long" and r.success]
    n = counts["num_kv_transfers_total"]
    if not longs or n != len(longs):
        return {}
    ttft = 1e3 * float(np.mean([r.ttft for r in longs]))
    call = counts["num_remote_prefill_microseconds_total"] / n / 1e3
    pull = counts["num_kv_transfer_microseconds_total"] / n / 1e3
    return {"n": n, "client_ttft_ms": ttft, "producer_ttft_ms": 1e3 * producer_ttft[0] / max(producer_ttft[1], 1),
            "producer_call_ms": call, "pull_ms": pull, "consumer_rest_ms": ttft - call - pull,
            "bytes_per_token": counts["num_kv_transfer_bytes_total"] / max(counts["num_kv_transfer_tokens_total"], 1)}


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- lone requests: the KV transfer --------------------------------------------------------------
def lone_request(target: str, prompt: list[int], output_len: int) -> Any:
    spec = serving.RequestSpec(prompt, output_len)

    async def one() -> Any:
        async with AsyncClient(target) as client:
            return await serving._one(client, spec, time.perf_counter())

    return asyncio.run(one())


def transfer_rows(setups: Setups, args: argparse.Namespace, vocab: tuple[int, set[int]]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed + 7919)
    ids = [t for t in range(vocab[0]) if t not in vocab[1]]
    rows = []
    for n in args.transfer_lens:
        for i in range(args.transfer_repeat + 1):  # the first of each length untimed
            prompt = [int(t) for t in rng.choice(ids, n)]
            before, ttft0 = engine_counts(setups.consumer.target), engine_ttft(setups.producer)
            res = lone_request(setups.consumer.target, prompt, args.transfer_output_len)
            d = delta(engine_counts(setups.consumer.target), before, TRANSFER_KEYS)
            ttft1 = engine_ttft(setups.producer)
            colocated = lone_request(setups.a.target, [int(t) for t in rng.choice(ids, n)], args.transfer_output_len)
            if i == 0:
                continue
            if not (res.success and colocated.success) or d["num_kv_transfers_total"] != 1:
                raise SystemExit(f"lone {n}-token request: {res.error or colocated.error or d}")
            rows.append({"prompt_len": n, "ttft_ms": 1e3 * res.ttft, "colocated_ttft_ms": 1e3 * colocated.ttft,
                         "transfer_ms": d["num_kv_transfer_microseconds_total"] / 1e3,
                         "remote_prefill_ms": d["num_remote_prefill_microseconds_total"] / 1e3,
                         "producer_ttft_ms": 1e3 * (ttft1[0] - ttft0[0]),
                         "bytes": d["num_kv_transfer_bytes_total"], "tokens": d["num_kv_transfer_tokens_total"]})
            print(f"lone {n:>5} tokens: TTFT {rows[-1]['ttft_ms']:.0f} ms (colocated "
                  f"{rows[-1]['colocated_ttft_ms']:.0f}), pull {rows[-1]['transfer_ms']:.1f} ms, producer call "
                  f"{rows[-1]['remote_prefill_ms']:.0f} ms", flush=True)
            time.sleep(0.2)
    return rows


# -- the control --------------------------------------------------------------------------------
def two_core_check() -> dict[str, float]:
    """GFLOP/s of benchmarks/two_core_check.py on core 0 alone, then on cores 0 and 1 at once."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(HERE / "two_core_check.py")]

    def gflops(out: str) -> float:
        found = re.search(r"([\d.]+) GFLOP/s", out)
        if found is None:
            raise SystemExit(f"two_core_check.py: no figure in {out!r}")
        return float(found.group(1))

    alone = gflops(subprocess.run([*cmd, "0"], env=env, capture_output=True, text=True, check=True).stdout)
    both = [subprocess.Popen([*cmd, str(core)], env=env, stdout=subprocess.PIPE, text=True) for core in (0, 1)]
    at_once = [gflops(p.communicate()[0]) for p in both]
    return {"alone_core0": alone, "both_core0": at_once[0], "both_core1": at_once[1],
            "sum_over_alone": sum(at_once) / alone}


# -- tables -------------------------------------------------------------------------------------
def median_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The medians over one set-up's runs of the figures the table shows."""
    figures = {
        "itl_p50": lambda s: s["itl_ms"]["p50"], "itl_p99": lambda s: s["itl_ms"]["p99"],
        "itl_max": lambda s: s["itl_ms"]["max"],
        "stream_ttft_p50": lambda s: s["ttft_ms"]["p50"], "stream_ttft_p99": lambda s: s["ttft_ms"]["p99"],
        "long_ttft_p50": lambda s: (s["long_prompt_ttft_ms"] or {}).get("p50", 0.0),
        "long_ttft_p99": lambda s: (s["long_prompt_ttft_ms"] or {}).get("p99", 0.0),
        "throughput": lambda s: s["stream_throughput"], "failed": lambda s: s["failed"]}
    return {k: float(np.median([f(r["summary"]) for r in rows])) for k, f in figures.items()}


def compare_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    med = {setup: median_summary(rows) for setup, rows in runs.items()}
    lines = ["| set-up | ITL p50 | ITL p99 | ITL max | stream TTFT p50 | stream TTFT p99 | long-prompt TTFT p50 | "
             "long-prompt TTFT p99 | output tok/s | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setup, m in med.items():
        lines.append(f"| {setup} | {m['itl_p50']:.1f} ms | {m['itl_p99']:.1f} ms | {m['itl_max']:.0f} ms | "
                     f"{m['stream_ttft_p50']:.0f} ms | {m['stream_ttft_p99']:.0f} ms | {m['long_ttft_p50']:.0f} ms | "
                     f"{m['long_ttft_p99']:.0f} ms | {m['throughput']:.0f} | {m['failed']:.0f} |")
    for suffix in ("", ", streams only"):
        colocated, disaggregated = f"colocated{suffix}", f"disaggregated{suffix}"
        if {colocated, disaggregated} <= med.keys():
            co, dis = med[colocated], med[disaggregated]
            each = [(c["summary"]["itl_ms"]["p99"] / d["summary"]["itl_ms"]["p99"],
                     d["summary"]["stream_throughput"] / c["summary"]["stream_throughput"])
                    for c, d in zip(runs[colocated], runs[disaggregated], strict=True)]
            lines.append(f"\n{suffix.lstrip(', ') or 'with the long prompts'}: p99 ITL colocated / disaggregated: "
                         f"{co['itl_p99'] / dis['itl_p99']:.2f}x (per run pair: "
                         + ", ".join(f"{e[0]:.2f}" for e in each) + "); output throughput disaggregated / colocated: "
                         f"{dis['throughput'] / co['throughput']:.2f}x (per run pair: "
                         + ", ".join(f"{e[1]:.2f}" for e in each) + ")")
    return "\n".join(lines)


def where_time_goes(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Per timed run: each server's CPU seconds, the rest of the machine's, and the streams' gaps split by
    what their engine was doing (`itl_attribution`); for the disaggregated pair, its transfer counts."""
    lines = ["| set-up | run | duration | CPU s: A / B / producer / consumer | client CPU s | others' CPU s | "
             "long prompts |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for setup, rows in runs.items():
        for i, r in enumerate(rows):
            cpu = " / ".join(f"{r['cpu_s'][k]:.1f}" for k in ("A", "B", "producer", "consumer"))
            lines.append(f"| {setup} | {i + 1} | {r['summary']['duration_s']:.1f} s | {cpu} | "
                         f"{r['client_cpu_s']:.1f} | {r['others_cpu_s']:.1f} | {r['summary']['num_long_prompts']} |")
    lines += ["", "| set-up | run | ITL p50 / p99 while a long prompt waits for its first token (gaps) | "
              "ITL p50 / p99 otherwise (gaps) | gap with a long prompt's first token, p50 (gaps) | "
              "long prompts' TTFT mean: client = producer call + pull + consumer (producer's own TTFT) |",
              "| --- | ---: | --- | --- | --- | --- |"]
    for setup, rows in runs.items():
        for i, r in enumerate(rows):
            x = r["itl_split"]
            t = r.get("long_prompts")
            extra = (f"{t['client_ttft_ms']:.0f} = {t['producer_call_ms']:.0f} + {t['pull_ms']:.1f} + "
                     f"{t['consumer_rest_ms']:.0f} ms ({t['producer_ttft_ms']:.0f} ms)") if t else "-"
            lines.append(f"| {setup} | {i + 1} | {x['during_p50']:.1f} / {x['during_p99']:.1f} ms ({x['during_n']}) | "
                         f"{x['outside_p50']:.1f} / {x['outside_p99']:.1f} ms ({x['outside_n']}) | "
                         f"{x['admitting_p50']:.1f} ms ({x['admitting_n']}) | {extra} |")
    return "\n".join(lines)


def transfer_table(rows: list[dict[str, Any]], unpadded: int) -> str:
    lines = [f"unpadded KV bytes per token (2 x layers x KV heads x head dim x itemsize): {unpadded}",
             "",
             "| prompt | requests | TTFT | colocated TTFT | producer call | producer TTFT | pull | "
             "pull per 1K tokens | pull / TTFT | bytes per token (stats) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted({r["prompt_len"] for r in rows}):
        rs = [r for r in rows if r["prompt_len"] == n]

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return float(np.median([r[key] for r in rs]))

        share = float(np.median([r["transfer_ms"] / r["ttft_ms"] for r in rs]))
        lines.append(f"| {n} | {len(rs)} | {med('ttft_ms'):.0f} ms | {med('colocated_ttft_ms'):.0f} ms | "
                     f"{med('remote_prefill_ms'):.0f} ms | {med('producer_ttft_ms'):.0f} ms | "
                     f"{med('transfer_ms'):.1f} ms | {med('transfer_ms') * 1024 / n:.1f} ms | {share:.1%} | "
                     f"{med('bytes') / med('tokens'):.0f} |")
    return "\n".join(lines)


def control_line(name: str, c: dict[str, float]) -> str:
    return (f"two_core_check {name}: core 0 alone {c['alone_core0']:.1f} GFLOP/s; both at once "
            f"{c['both_core0']:.1f} + {c['both_core1']:.1f} GFLOP/s = {c['sum_over_alone']:.2f}x alone")


# -- main ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model for all four servers (default: a random Llama written "
                   "to --model-dir)")
    p.add_argument("--model-dir", default="/tmp/jaxcpp-disagg-bench-model")
    p.add_argument("--serve-args", default="--dtype float32 --max-model-len 4352 --num-pages 4096 --max-num-seqs 32 "
                   "--max-num-batched-tokens 256 --log-stats-interval-s 0",
                   help="flags for every `jaxcpp serve` (chunked prefill is on by default)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-input-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=1024)
    p.add_argument("--long-prompt-len", type=int, default=1536)
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--inject-at", type=float, default=1.0, help="first long prompt, s after start")
    p.add_argument("--inject-every", type=float, default=1.0)
    p.add_argument("--inject-until", type=float, default=120.0, help="no long prompt after this (s), nor after "
                   "the last stream has ended")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per set-up, alternating")
    p.add_argument("--transfer-lens", type=lambda s: [int(x) for x in s.split(",") if x], default=[1024, 2048, 4096],
                   help="lone prompt lengths for the KV transfer (\"\": none)")
    p.add_argument("--transfer-repeat", type=int, default=3)
    p.add_argument("--transfer-output-len", type=int, default=4)
    p.add_argument("--no-control", action="store_true", help="skip two_core_check.py before and after")
    p.add_argument("--no-streams-only", dest="streams_only", action="store_false",
                   help="skip the one run per set-up of the streams alone, after the timed runs")
    p.add_argument("--pin-at-exec", action="store_true",
                   help="pin each server before exec (XLA:CPU then makes a one-thread pool, on which jax's transfer "
                        "server sends too); default: once it is up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the markdown tables here")
    p.add_argument("--result-file", default=None, help="write every run's summary and counts here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores (0 and 1)")
    controls = {"before": two_core_check()} if not args.no_control else {}
    if controls:
        print(control_line("before", controls["before"]), flush=True)
    model = args.model or random_model(Path(args.model_dir))
    t = time.time()
    setups = Setups(args, model)
    print(f"four servers up in {time.time() - t:.0f} s", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": []}
    try:
        with Client(setups.consumer.target) as c:
            info = c.model_info()
        vocab = (info.vocab_size, set(info.eos_token_ids))
        for setup in runs:  # warm-up: one full untimed run each
            run_setup(setups, setup, args, vocab, args.seed + 1000)
        for i in range(args.repeat):
            for setup in runs:
                row = run_setup(setups, setup, args, vocab, args.seed + i)
                runs[setup].append(row)
                s = row["summary"]
                print(f"run {i + 1} {setup:<14} ITL p50 {s['itl_ms']['p50']:.1f} p99 {s['itl_ms']['p99']:.1f} ms  "
                      f"long TTFT p50 {(s['long_prompt_ttft_ms'] or {}).get('p50', 0):.0f} ms  "
                      f"{s['stream_throughput']:.0f} tok/s  ({s['duration_s']:.0f} s)", flush=True)
        if args.streams_only:  # the decode side alone: what each set-up does with no prompt to prefill
            quiet = argparse.Namespace(**{**vars(args), "long_prompt_len": 0})
            for setup in ("colocated", "disaggregated"):
                runs[f"{setup}, streams only"] = [run_setup(setups, setup, quiet, vocab, args.seed + 500)]
        lone = transfer_rows(setups, args, vocab) if args.transfer_lens else []
    finally:
        setups.stop()
    if controls:
        controls["after"] = two_core_check()
    unpadded = kv_bytes_per_token(model, info.kv_cache_dtype)
    report = [compare_table(runs), "", where_time_goes(runs), ""]
    if lone:
        report += [transfer_table(lone, unpadded), ""]
    report += [control_line(name, c) for name, c in controls.items()]
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"args": vars(args), "model": model, "runs": runs,
                                                      "lone": lone, "controls": controls,
                                                      "kv_bytes_per_token": unpadded}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
