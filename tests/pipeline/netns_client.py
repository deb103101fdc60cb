"""The multi-host test's gRPC client, run inside the head's network namespace (the test process lives in
another one and cannot reach the head's address):

    ip netns exec NS python -m tests.pipeline.netns_client TARGET REQUESTS_JSON

REQUESTS_JSON is a list of {"prompt": [ids], "sampling": {...}, "wait": bool}. All requests are sent at
once, each on its own thread. Once every request with "wait" has its first token the client prints
`STARTED` (so the test can kill or stop something while they are in flight), then one JSON line: per
request its token ids, finish reason, or the gRPC status and message it ended with, and when it
ended (time.monotonic(), which every process on the machine shares).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from jaxcpp.serving.client import Client, ClientError


def _one(client: Client, request: dict[str, Any], started: threading.Barrier, out: dict[str, Any]) -> None:
    waiting = request.get("wait", False)
    out["token_ids"] = []
    try:
        for delta in client.stream(request["prompt"], **request["sampling"]):
            out["token_ids"] += delta.token_ids
            out["finish_reason"] = delta.finish_reason
            if waiting:
                waiting = False
                try:
                    started.wait()
                except threading.BrokenBarrierError:  # another ended early; main says so
                    pass
    except ClientError as err:
        out["code"], out["message"] = err.status.name, err.message
    finally:
        out["ended"] = time.monotonic()
        if waiting:  # ended before its first token: do not hold the others
            started.abort()


def main(target: str, requests: list[dict[str, Any]]) -> None:
    started = threading.Barrier(sum(1 for r in requests if r.get("wait")) + 1)
    results: list[dict[str, Any]] = [{} for _ in requests]
    with Client(target, timeout=120) as client:
        client.wait_ready(60)
        threads = [threading.Thread(target=_one, args=(client, r, started, out))
                   for r, out in zip(requests, results, strict=True)]
        for t in threads:
            t.start()
        try:
            started.wait()
            print("STARTED", flush=True)
        except threading.BrokenBarrierError:
            print("STARTED (a request ended before its first token)", flush=True)
        for t in threads:
            t.join()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
