"""Messages on a stage process's control channel: a JSON header plus raw numpy buffers. No pickle.

    send(conn, {"op": "step", "id": 7, ...}, [packed])     # header, then one frame per array
    header, arrays = recv(conn)

`conn` is a `multiprocessing.connection.Connection` (a TCP socket, authenticated with an HMAC
challenge when it was opened). Only `send_bytes`/`recv_bytes` are used, so nothing received is ever
unpickled: a peer can send bad data, never code. Arrays travel as their bytes with dtype and shape in
the header; a few KB per step (the packed StepInput), or the tokens and logits coming back.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def send(conn: Any, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:  # type: ignore[assignment]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {**header, "_arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    conn.send_bytes(json.dumps(header).encode())
    for a in arrays:
        conn.send_bytes(memoryview(a).cast("B") if a.size else b"")


def recv(conn: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    header = json.loads(conn.recv_bytes())
    arrays = []
    for dtype, shape in header.pop("_arrays"):
        data = conn.recv_bytes()
        arrays.append(np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape))
    return header, arrays
