"""Late activation hops in a Perfetto trace of a PP 2 engine (`--trace-file`, or stage_processes.py --trace).

    python3 benchmarks/late_hops.py TRACE.json [TRACE.json ...] [--bound-ms 20]

A hop of micro-batch k is late when stage 1 starts k more than --bound-ms after both stage 0 finished k
and stage 1 finished k - 1 (its input and the stage were both ready). Reads only the stages' own
forward spans; no jax, no project import.
"""

from __future__ import annotations

import argparse
import json


def forwards_by_step(path: str) -> dict[int, dict[int, dict]]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    steps: dict[int, dict[int, dict]] = {}
    for event in events:
        if event.get("cat") == "forward":
            step = event["args"].get("step", event["args"].get("ticket"))  # "ticket" in traces before step ids
            steps.setdefault(step, {})[event["args"]["stage"]] = event
    return steps


def late_hops(path: str, bound_ms: float) -> tuple[int, int, float]:
    """(late hops, hops, seconds lost beyond readiness)."""
    late, hops, lost, previous = 0, 0, 0.0, None
    for _, stages in sorted(forwards_by_step(path).items()):
        producer, consumer = stages.get(0), stages.get(1)
        if producer is None or consumer is None:
            continue
        ready = producer["ts"] + producer["dur"]
        if previous is not None:
            ready = max(ready, previous["ts"] + previous["dur"])
        wait_ms = (consumer["ts"] - ready) / 1e3
        hops += 1
        if wait_ms > bound_ms:
            late, lost = late + 1, lost + wait_ms / 1e3
        previous = consumer
    return late, hops, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--bound-ms", type=float, default=20.0)
    args = parser.parse_args()
    for path in args.traces:
        late, hops, lost = late_hops(path, args.bound_ms)
        print(f"{path}: {late} of {hops} hops late (> {args.bound_ms:g} ms after input and stage were ready), "
              f"{lost:.2f} s lost")


if __name__ == "__main__":
    main()
