"""What the shared output loop costs per output: `Admission.deltas` (serving/admission.py, both front
ends) against the loop each front end wrote inline before it (queue get, failure checks, process,
needs_abort), on the same outputs, in one asyncio loop, no engine and no network.

    python benchmarks/admission_overhead.py [--outputs 20000] [--repeat 7]

The difference is one async-generator hop and a tuple per output; it prints microseconds per output
for both (the median of `--repeat` alternated runs) and their difference, to set against an ITL of
milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from jaxcpp.config import ServerConfig
from jaxcpp.core.outputs import RequestMetrics, RequestOutput
from jaxcpp.output_processor import RequestState, needs_abort
from jaxcpp.sampling_params import SamplingParams
from jaxcpp.serving.admission import Admission, OutputStream
from jaxcpp.serving.metrics import ServingMetrics
from jaxcpp.tokenizer import ByteTokenizer


class _NoEngine:
    """What `deltas` reaches of the engine loop: `abort` (never called here: no stop strings)."""

    engine: Any = None

    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass


def _outputs(n: int) -> list[RequestOutput]:
    metrics = RequestMetrics(0.0)
    outs = [RequestOutput("r", [97, 98], [], [97 + i % 26], False, None, metrics, num_generated=i + 1)
            for i in range(n - 1)]
    return [*outs, RequestOutput("r", [97, 98], [], [97], True, "length", metrics, num_generated=n)]


def _fill(stream: OutputStream, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        stream.outputs.put_nowait(out)


async def _shared(admission: Admission, outputs: list[RequestOutput]) -> float:
    state = RequestState("r", SamplingParams(max_tokens=len(outputs)), ByteTokenizer())
    stream = OutputStream("r", len(outputs) + 1, lambda s: None)
    _fill(stream, outputs)
    start = time.perf_counter()
    async for _ in admission.deltas(stream, [state]):
        pass
    return time.perf_counter() - start


async def _inline(engine: _NoEngine, outputs: list[RequestOutput]) -> float:
    """The loop as gRPC's Generate had it before the shared admission."""
    state = RequestState("r", SamplingParams(max_tokens=len(outputs)), ByteTokenizer())
    stream = OutputStream("r", len(outputs) + 1, lambda s: None)
    _fill(stream, outputs)
    start = time.perf_counter()
    while not state.finished:
        out = await stream.outputs.get()
        if isinstance(out, BaseException):
            raise out
        if out.finish_reason == "error":
            raise RuntimeError(out.error)
        delta = state.process(out)
        if needs_abort(out, delta):
            engine.abort(out.request_id, "stop")
    return time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    engine = _NoEngine()
    admission = Admission(ServerConfig(port=0), ServingMetrics())
    admission._engine = engine  # the loop reaches only `abort`
    admission.tokenizer = ByteTokenizer()
    outputs = _outputs(args.outputs)
    shared, inline = [], []
    for _ in range(args.repeat):
        inline.append(await _inline(engine, outputs) / args.outputs * 1e6)
        shared.append(await _shared(admission, outputs) / args.outputs * 1e6)
    a, b = statistics.median(inline), statistics.median(shared)
    print(f"{args.outputs} outputs, median of {args.repeat} alternated runs:")
    print(f"  inline loop (before):        {a:.2f} us per output")
    print(f"  Admission.deltas (shared):   {b:.2f} us per output")
    print(f"  difference:                  {b - a:+.2f} us per output ({b / a:.3f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    asyncio.run(main(parser.parse_args()))
