"""What a constrained stream costs against a free one, offline on the bundled tiny model (CPU).

    .venv/bin/python benchmarks/structured_outputs.py [--rounds 3] [--tokens 64]
    .venv/bin/python benchmarks/structured_outputs.py --pairs 20 [--random-hidden 512 --random-layers 8]

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

`--pairs N` runs only the ITL comparison, as N back-to-back pairs per scenario (a free run and a
constrained run, which first alternating), and prints the median, interquartile range and range of
the pairs' ratios, the same for the process's CPU time per engine step (every thread: on a CPU host
the engine and XLA:CPU share the cores, and other load moves this far less than a clock), and per step:
the mask fill, the deferred draw's dispatch (the executor's `sample`) and the engine's host phases
(the `--trace-file` ones). `--random-hidden W` runs it on a random Llama
(byte vocabulary, `--random-layers` layers) whose step costs more than the host's work per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections import defaultdict

from jaxcpp import LLM, SamplingParams
from jaxcpp.core import constrained as constrained_module
from jaxcpp.structured.constraint import StructuredOutputs
from jaxcpp.structured.grammar import GrammarCompiler

LONG_STRING = StructuredOutputs.from_schema({"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"]})


class Probe:
    """Wraps the engine's mask fill (`step_bitmask`), the executor's deferred draw (`sample`) and its
    host phases (the `--trace-file` ones: schedule, build, mask, dispatch, wait, postprocess) for one run."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self.mask: list[float] = []
        self.draw: list[float] = []
        self.phases: dict[str, float] = defaultdict(float)
        self._fill = constrained_module.step_bitmask
        constrained_module.step_bitmask = self._timed(self._fill, self.mask, skip_none=True)
        executor = engine.executor
        self._record, self._sample = executor.record_host_phases, getattr(executor, "sample", None)
        executor.record_host_phases = self._phases
        if self._sample is not None:
            executor.sample = self._timed(self._sample, self.draw)

    @staticmethod
    def _timed(fn, into: list[float], skip_none: bool = False):  # noqa: ANN001, ANN205
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if not (skip_none and out is None):
                into.append(time.perf_counter() - start)
            return out
        return call

    def _phases(self, phases) -> None:  # noqa: ANN001
        for phase in phases:
            self.phases[phase.name] += phase.end - phase.start
        self._record(phases)

    def close(self) -> None:
        constrained_module.step_bitmask = self._fill
        del self.engine.executor.record_host_phases
        if self._sample is not None:
            del self.engine.executor.sample


def run(llm: LLM, constrained: int, free: int, tokens: int) -> dict[str, float]:
    engine = llm.engine
    probe = Probe(engine)
    arrivals: dict[str, list[float]] = defaultdict(list)
    for i in range(constrained + free):
        so = LONG_STRING if i < constrained else None
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=so is None, structured_outputs=so)
        engine.add_request(f"{'c' if so else 'f'}{i}-{time.monotonic_ns()}", f"Write {i}:", params)
    steps, cpu = [], time.process_time()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            arrivals[out.request_id].extend([time.perf_counter()] * len(out.new_token_ids))
        steps.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu  # every thread of the process: the engine's, the device's (XLA:CPU), the rest
    probe.close()
    itl = {kind: [b - a for rid, t in arrivals.items() if rid[0] == kind for a, b in zip(t, t[1:], strict=False)]
           for kind in "cf"}
    per_step = {f"{name}_per_step_ms": total * 1e3 / len(steps) for name, total in probe.phases.items()}
    return {"itl_constrained_ms": _median_ms(itl["c"]), "itl_free_ms": _median_ms(itl["f"]),
            "step_ms": _median_ms(steps), "mask_ms": _median_ms(probe.mask), "draw_ms": _median_ms(probe.draw),
            "steps": len(steps), "cpu_ms": cpu * 1e3 / len(steps), **per_step}


def pairs(llm: LLM, n: int, tokens: int) -> None:
    """Back-to-back pairs of a free and a constrained run (order alternating pair by pair), alone and in
    a batch of 32 (32 free against 1 constrained + 31 free and against 32 constrained): the ratio of
    each pair's ITL medians, then the median and interquartile range of the ratios."""
    scenarios = {"alone": ((0, 1), (1, 0), "itl_constrained_ms"),
                 "batch 32, 1 constrained + 31 free": ((0, 32), (1, 31), "itl_constrained_ms"),
                 "batch 32, 32 constrained": ((0, 32), (32, 0), "itl_constrained_ms")}
    ratios: dict[str, list[float]] = defaultdict(list)
    cpu_ratios: dict[str, list[float]] = defaultdict(list)
    runs: dict[str, dict[str, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
    loads = []
    for i in range(n):
        loads.append(os.getloadavg()[0])
        for name, (free, constrained, key) in scenarios.items():
            order = [("free", free), ("constrained", constrained)]
            got = dict((kind, run(llm, *cf, tokens)) for kind, cf in (order if i % 2 == 0 else order[::-1]))
            ratios[name].append(got["constrained"][key] / got["free"]["itl_free_ms"])
            cpu_ratios[name].append(got["constrained"]["cpu_ms"] / got["free"]["cpu_ms"])
            for kind, r in got.items():
                runs[name][kind].append(r)
    print(f"pairs: {n}, {tokens} tokens a stream, load {min(loads):.1f}-{max(loads):.1f} (1 min), "
          f"{os.cpu_count()} cores")
    print(f"{'scenario':36} {'ITL free':>9} {'ITL constr.':>11} {'pair ratio':>10} {'IQR':>13} {'range':>13} "
          f"{'CPU/step ratio':>15} {'IQR':>13}")
    for name, rs in ratios.items():
        q1, _, q3 = _quartiles(rs)
        c1, _, c3 = _quartiles(cpu_ratios[name])
        free = statistics.median(r["itl_free_ms"] for r in runs[name]["free"])
        constrained = statistics.median(r[scenarios[name][2]] for r in runs[name]["constrained"])
        print(f"{name:36} {free:6.2f} ms {constrained:8.2f} ms {statistics.median(rs):9.2f}x "
              f"{q1:5.2f}-{q3:.2f}x {min(rs):5.2f}-{max(rs):.2f}x {statistics.median(cpu_ratios[name]):14.2f}x "
              f"{c1:5.2f}-{c3:.2f}x")
    print("per step (medians over runs): step, mask fill per fill, deferred draw dispatch, host phases (ms/step)")
    for name in scenarios:
        for kind in ("free", "constrained"):
            rs = runs[name][kind]
            keys = sorted({k for r in rs for k in r if k.endswith("_per_step_ms")})
            med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in
                   ["step_ms", "mask_ms", "draw_ms", "steps", "cpu_ms", *keys]}
            phases = " ".join(f"{k.removesuffix('_per_step_ms')} {v:.3f}" for k, v in med.items()
                              if k.endswith("_per_step_ms"))
            print(f"  {name:34} {kind:11} step {med['step_ms']:.2f} mask {med['mask_ms']:.3f} "
                  f"draw {med['draw_ms']:.3f} steps {med['steps']:.0f} cpu {med['cpu_ms']:.2f} | {phases}")


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    return tuple(statistics.quantiles(xs, n=4)) if len(xs) > 1 else (xs[0],) * 3  # type: ignore[return-value]


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


def random_llama(hidden: int, layers: int) -> str:
    """A random Llama on the byte tokenizer's vocabulary (so the grammars match), in a temporary folder."""
    import tempfile

    import jax

    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params
    from jaxcpp.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    config = LlamaConfig(vocab_size=264, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                         eos_token_ids=tokenizer.eos_token_ids)
    folder = tempfile.mkdtemp(prefix="structured_outputs_llama_")
    save_hf(folder, init_params(config, jax.random.key(0)), config)
    tokenizer.save(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sync-baseline", action="store_true", help="also free streams with async scheduling off")
    parser.add_argument("--sampler-only", action="store_true", help="only the sampler's mask cost")
    parser.add_argument("--pairs", type=int, default=0, help="only N back-to-back free/constrained pairs")
    parser.add_argument("--random-hidden", type=int, default=0,
                        help="a random Llama of this width (byte vocabulary) instead of the tiny model")
    parser.add_argument("--random-layers", type=int, default=8)
    args = parser.parse_args()
    if args.sampler_only:
        return print_sampler_mask_cost()
    model = random_llama(args.random_hidden, args.random_layers) if args.random_hidden else "tiny"
    llm = LLM(model, dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
              log_stats_interval_s=0)
    if args.pairs:
        run(llm, 1, 1, 8)  # warm: the grammar pool, the tokenizer, the programs
        run(llm, 0, 32, 8)
        run(llm, 32, 0, 8)
        pairs(llm, args.pairs, args.tokens)
        llm.engine.close()
        if model != "tiny":
            shutil.rmtree(model)  # the random Llama's weights (hundreds of MB)
        return None
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
        keys = ("itl_constrained_ms", "itl_free_ms", "step_ms", "mask_ms")
        med = {k: statistics.median(r[k] for r in runs) for k in keys}
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
