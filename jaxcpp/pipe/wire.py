"""Messages on a stage process's control channel: a JSON header plus raw numpy buffers. No pickle.

    send(conn, {"op": "step", "id": 7, ...}, [packed])     # one frame: header + the arrays' bytes
    header, arrays = recv(conn)

`conn` is a `multiprocessing.connection.Connection` (a TCP socket, authenticated with an HMAC
challenge when it was opened). Only `send_bytes`/`recv_bytes` are used, so nothing received is ever
unpickled: a peer can send bad data, never code. Arrays travel as their bytes with dtype and shape in
the header; a few KB per step (the packed StepInput), or the tokens and logits coming back.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import numpy as np

_LEN = struct.Struct("<I")


def no_delay(conn: Any) -> None:
    """Small control messages must not wait for Nagle's algorithm and a delayed ACK (~40 ms each)."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup: same socket
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


def send(conn: Any, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:  # type: ignore[assignment]
    """One frame: header length, JSON header (with each array's dtype and shape), the arrays' bytes."""
    arrays = [np.asarray(a) for a in arrays]  # tobytes() below is C order (ascontiguousarray would make 0-d 1-d)
    head = json.dumps({**header, "_arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    conn.send_bytes(b"".join([_LEN.pack(len(head)), head, *(a.tobytes() for a in arrays)]))


def recv(conn: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    frame = conn.recv_bytes()
    (n,) = _LEN.unpack_from(frame)
    header = json.loads(frame[_LEN.size:_LEN.size + n])
    offset, arrays = _LEN.size + n, []
    for dtype, shape in header.pop("_arrays"):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(frame, dtype=dt, count=count, offset=offset).reshape(tuple(shape)))
        offset += count * dt.itemsize
    return header, arrays
