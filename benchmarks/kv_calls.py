"""What the consumer's engine thread spends on a KV transfer's calls, now that it makes them all itself
(`jaxcpp.core.disaggregation`): `pull_kv` (starts the pull, returns at once), `kv_arrived` (polled each
step, never blocking) and `import_kv` (the scatter into its pages, dispatched).

An in-process producer and consumer of a small random Llama (tests/pipeline/conftest.py's) on this
machine, over loopback; the first round of prompts is untimed (connections to the producer's transfer
server are made there).

    .venv/bin/python benchmarks/kv_calls.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxcpp import LLM  # noqa: E402
from jaxcpp.config import ServerConfig  # noqa: E402
from jaxcpp.serving import Client  # noqa: E402
from jaxcpp.serving.lifecycle import ServerThread  # noqa: E402
from tests.disagg.test_disaggregation import CONSUMER, PRODUCER, PROMPTS  # noqa: E402
from tests.pipeline.conftest import ENGINE_DEFAULTS, write_random_model  # noqa: E402

CALLS = ("pull_kv", "kv_arrived", "import_kv")


def timed(executor: Any, times: dict[str, list[float]]) -> None:
    """Wrap each KV call of `executor` so its wall time lands in `times[name]`."""
    for name in CALLS:
        real = getattr(executor, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _real(*args)
            finally:
                times[_name].append(time.perf_counter() - start)

        setattr(executor, name, spy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of the six test prompts (5-150 tokens)")
    args = parser.parse_args()
    model = write_random_model(Path(tempfile.mkdtemp()))
    servers = ServerConfig(port=0, http_port=0)
    producer = ServerThread(LLM(model=model, **ENGINE_DEFAULTS, kv_transfer_config=PRODUCER).engine, servers).start()
    consumer = ServerThread(LLM(model=model, **ENGINE_DEFAULTS, kv_transfer_config=CONSUMER,
                                prefill_servers=f"127.0.0.1:{producer.port}").engine, servers).start()
    times: dict[str, list[float]] = {name: [] for name in CALLS}
    try:
        with Client(f"127.0.0.1:{consumer.port}", timeout=60) as client:
            client.wait_ready(60)
            for p in PROMPTS:  # untimed: connections made
                client.generate(p, max_tokens=2, temperature=0)
            timed(consumer.server.engine_loop.engine.executor, times)
            for _ in range(args.rounds):
                for p in PROMPTS:
                    client.generate(p, max_tokens=2, temperature=0)
    finally:
        consumer.stop(grace=0)
        producer.stop(grace=0)
    requests = len(times["import_kv"])
    print(f"{requests} requests; kv_arrived polls per request: {len(times['kv_arrived']) / requests:.1f}")
    for name in CALLS:
        ms = sorted(t * 1e3 for t in times[name])
        print(f"{name:>10}: n={len(ms)}  median {statistics.median(ms):.3f} ms  max {ms[-1]:.3f} ms")


if __name__ == "__main__":
    main()
