"""What a constrained stream costs against a free one, offline on the bundled tiny model (CPU).

    .venv/bin/python benchmarks/structured_outputs.py [--rounds 3] [--tokens 64]

Scenarios, each run `--rounds` times, interleaved (A/B on a loaded machine):
    alone      1 free stream; 1 constrained stream (a JSON schema whose string runs past max_tokens)
    batch 32   32 free streams; 1 constrained + 31 free; 32 constrained
Each stream decodes `--tokens` tokens (free ones with ignore_eos, so both kinds run the same length).
`--sync-baseline` adds free streams on an engine with async scheduling off. Printed: the median
inter-token latency (ITL) of each kind of stream, the median engine step, and the
host time of the step's mask fill (`step_bitmask`, the engine's "mask" phase) per step. Then the
grammar compile of a large schema (200 properties, nested objects, enums, bounded arrays): the first
request's (a build in the pool), and a second request's (the cache's copy). Last, the sampler program alone
at real vocabularies: without a mask and with the all-ones mask every free step now carries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

from jaxcpp import LLM, SamplingParams
from jaxcpp.core import engine as engine_module
from jaxcpp.structured.constraint import StructuredOutputs
from jaxcpp.structured.grammar import GrammarCompiler

LONG_STRING = StructuredOutputs.from_schema({"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"]})


class MaskTimer:
    """Wraps the engine's step_bitmask: the host seconds of every step's mask fill."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._fill = engine_module.step_bitmask

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        start = time.perf_counter()
        out = self._fill(*args, **kwargs)
        if out is not None:
            self.seconds.append(time.perf_counter() - start)
        return out


def run(llm: LLM, constrained: int, free: int, tokens: int) -> dict[str, float]:
    engine, timer = llm.engine, MaskTimer()
    engine_module.step_bitmask = timer
    arrivals: dict[str, list[float]] = defaultdict(list)
    for i in range(constrained + free):
        so = LONG_STRING if i < constrained else None
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=so is None, structured_outputs=so)
        engine.add_request(f"{'c' if so else 'f'}{i}-{time.monotonic_ns()}", f"Write {i}:", params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            arrivals[out.request_id].extend([time.perf_counter()] * len(out.new_token_ids))
        steps.append(time.perf_counter() - start)
    engine_module.step_bitmask = timer._fill
    itl = {kind: [b - a for rid, t in arrivals.items() if rid[0] == kind for a, b in zip(t, t[1:], strict=False)]
           for kind in "cf"}
    return {"itl_constrained_ms": _median_ms(itl["c"]), "itl_free_ms": _median_ms(itl["f"]),
            "step_ms": _median_ms(steps), "mask_ms": _median_ms(timer.seconds)}


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def large_schema() -> dict:
    item = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                             "kind": {"enum": ["a", "b", "c", "d"]},
                                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                      "maxItems": 4}},
            "required": ["id", "kind"], "additionalProperties": False}
    props = {f"field_{i}": item if i % 4 == 0 else {"type": ["string", "number", "boolean"][i % 3]}
             for i in range(200)}
    return {"type": "object", "properties": props, "required": list(props)[:50], "additionalProperties": False}


def compile_times(llm: LLM) -> tuple[float, float, float]:
    """(checking the constraint where the request is built, the first request's build in the pool, a
    second request's: the cache's copy), seconds."""
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.sizing.spec.config.vocab_size)
    compiler.matcher(compiler.compile(StructuredOutputs(regex="x")))  # the tokenizer built, out of the timing
    start = time.perf_counter()
    schema = StructuredOutputs.from_schema(large_schema())
    checked = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(compiler.compile(schema))
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(compiler.compile(schema))
    cached = time.perf_counter() - start
    compiler.close()
    return checked, first, cached


def sampler_mask_cost(vocab: int, rows: int, temperature: float, calls: int = 30) -> tuple[float, float]:
    """Median ms of the plain sampler program without a mask and with an all-ones one (a free step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcpp.runtime import sampler

    zeros, ones = jnp.zeros(rows, jnp.float32), jnp.ones(rows, jnp.float32)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)), jnp.float32)
    x = sampler.SamplingInput(logits, jnp.full(rows, temperature, jnp.float32), jnp.zeros(rows, jnp.int32),
        ones, jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32), zeros, zeros, zeros, ones,
        jnp.full(rows, -1, jnp.int32), jnp.full(rows, -1, jnp.int32), jnp.full((rows, 8), -1, jnp.int32),
        jnp.zeros(rows, jnp.int32), jnp.zeros(64, jnp.int32), jnp.full(64, -1, jnp.int32))
    mask = jnp.full((rows, (vocab + 31) // 32), -1, jnp.int32)
    plain, masked = jax.jit(sampler.sample_step), jax.jit(sampler.sample_step)
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    for _ in range(calls):  # interleaved
        for name, call in (("plain", lambda: plain(x, None)), ("masked", lambda: masked(x, None, mask))):
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return _median_ms(times["plain"][5:]), _median_ms(times["masked"][5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sync-baseline", action="store_true", help="also free streams with async scheduling off")
    parser.add_argument("--sampler-only", action="store_true", help="only the sampler's mask cost")
    args = parser.parse_args()
    if args.sampler_only:
        return print_sampler_mask_cost()
    llm = LLM("tiny", dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
              log_stats_interval_s=0)
    scenarios = {"alone free": (0, 1), "alone constrained": (1, 0), "batch 32 free": (0, 32),
                 "batch 32, 1 constrained": (1, 31), "batch 32 constrained": (32, 0)}
    if args.sync_baseline:  # what a step costs without async scheduling's overlap, for comparison
        sync = LLM("tiny", dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
                   log_stats_interval_s=0, async_scheduling=False)
    run(llm, 1, 1, 8)  # warm: the grammar pool and the tokenizer
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, (c, f) in scenarios.items():
            results[name].append(run(llm, c, f, args.tokens))
        if args.sync_baseline:
            results["alone free, no async scheduling"].append(run(sync, 0, 1, args.tokens))
            results["batch 32 free, no async scheduling"].append(run(sync, 0, 32, args.tokens))
    print(f"load: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores; {args.rounds} rounds, {args.tokens} tokens")
    print(f"{'scenario':28} {'ITL constrained':>16} {'ITL free':>10} {'step':>8} {'mask fill':>10}")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:28} {med['itl_constrained_ms']:13.2f} ms {med['itl_free_ms']:7.2f} ms "
              f"{med['step_ms']:5.2f} ms {med['mask_ms']:7.3f} ms")
    checked, first, cached = compile_times(llm)
    print(f"large schema ({len(json.dumps(large_schema()))} bytes): checked when built {checked * 1e3:.1f} ms, "
          f"first request's build {first * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
    llm.engine.close()
    print_sampler_mask_cost()


def print_sampler_mask_cost() -> None:
    for vocab in (264, 32000, 128256):
        for temperature in (0.0, 1.0):
            plain, masked = sampler_mask_cost(vocab, 64, temperature)
            print(f"sampler, 64 rows, vocab {vocab}, temperature {temperature:g}: {plain:.2f} ms plain, "
                  f"{masked:.2f} ms with an all-ones mask ({masked / plain:.2f}x)")


if __name__ == "__main__":
    main()
