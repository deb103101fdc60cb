"""Stage supervision, the head's side: each stage's link (its connection, process and addresses), the
ports the head picks, spawning a stage process and watching it end, and stopping it. No jax.

    ln = StageLink(s)
    spawn_stage(ln, control_port, authkey, advertise)    # `python -m jaxcpp.runtime.stage_process ...`
    how_it_ended(ln)                                     # its exit code or signal, and its last log line
    stop_stage(ln, grace)                                # "stop", then killed when it does not exit in time

The start-up handshake is `jaxcpp.head.startup`; the executor proper, `jaxcpp.head.mp_executor`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Listener
from typing import Any

from jaxcpp.core.executor import ExecutorError
from jaxcpp.pipe import wire
from jaxcpp.pipe.cluster import CONTROL_KEY_ENV

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StageLink:
    """One stage as the head sees it: its control connection, its process (when the head spawned it), what
    it reported of itself, and the threads that read it."""

    index: int
    conn: Any = None
    pid: int | None = None
    host: str = ""
    address: str = ""                      # the address it advertises (its transfer server binds it)
    transfer: str = ""                     # its transfer server, once ready
    layers: tuple[int, int] = (0, 0)       # its layers [start, end), once ready
    compilations: int = 0                  # the stage's own count, as of its latest message
    sized: tuple[str, int] | None = None   # the (dtype, KV pages) it built, as it reported them
    mla_rebuild_weight: float | None = None  # MLA: the weight its prefill rule gives the rebuild (--mla-prefill)
    clock_offset: float = 0.0              # add to the stage's perf_counter to get the head's
    process: subprocess.Popen[bytes] | None = None   # when the head spawned it
    log_tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))
    reader: threading.Thread | None = None
    log_reader: threading.Thread | None = None
    replies: queue.SimpleQueue[dict[str, Any]] = dataclasses.field(default_factory=queue.SimpleQueue)
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def where(self) -> str:
        """pid, host and addresses, for error messages: what an operator needs to find the stage."""
        if self.pid is None:
            return f"pid {self.process.pid}, not connected" if self.process is not None else ""
        transfer = f", transfer server {self.transfer}" if self.transfer else ""
        return f"pid {self.pid} on {self.host} at {self.address}{transfer}"

    def error(self, message: str) -> ExecutorError:
        return ExecutorError(message, stage=self.index, where=self.where())


# How long a dead stage's last log lines may take to come through its pipe (0.5 s was not enough at load 17).
LOG_DRAIN_S = 5.0

# Where free_port draws from: above the well-known services' ports, below the kernel's ephemeral range.
_FREE_PORTS_FROM = 10000
_DEFAULT_EPHEMERAL = (32768, 60999)


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel takes outgoing connections' source ports from (Linux's default elsewhere)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that another process binds seconds later.

    Drawn below the ephemeral range: a port the kernel hands out for a bind to 0 lies in that range, where
    outgoing connections take their source ports, and once on a busy machine such a port was taken
    before stage 0 bound it (its jax.distributed coordinator then failed: "Failed to start RPC server")."""
    low = ephemeral_ports()[0]
    below = range(_FREE_PORTS_FROM, low)
    for port in random.sample(below, 64) if len(below) >= 1024 else ():
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range, or none of 64 free: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def how_it_ended(ln: StageLink, wait_s: float = 1.0) -> str:
    process = ln.process
    if process is None:
        return "its control connection closed (process gone, or its host unreachable: see that host's log)"
    try:
        code = process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return f"process {process.pid} closed its control connection"
    if ln.log_reader is not None:  # its last lines, still in the pipe: the reader ends at the pipe's end,
        ln.log_reader.join(timeout=LOG_DRAIN_S)  # which a loaded host can take seconds to reach
    if code < 0 and -code in (signal.SIGKILL, signal.SIGTERM):  # killed from outside: its log says nothing
        return f"process {process.pid} was killed by {signal.Signals(-code).name}"
    ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    last = last_words(ln.log_tail) if code != 0 else ""
    return f"process {process.pid} {ended}" + (f"; its log ends: {last}" if last else "")


def last_words(lines: collections.deque[str]) -> str:
    """Why a process died, from its last log lines: jax's fatal line (a failed CHECK in native code),
    else its last line (a Python exception's)."""
    fatal = [line for line in lines if re.match(r"F\d{4} ", line)]
    last = fatal[-1] if fatal else (lines[-1] if lines else "")
    return last if len(last) <= 400 else last[:400] + " ..."


def forward_log(ln: StageLink, stream: Any) -> None:
    """A spawned stage's stderr, passed on to the head's; the lines that are not stack frames are kept."""
    for raw in stream:
        line = raw.decode(errors="replace")
        sys.stderr.write(line)
        if line.strip() and not line.startswith((" ", "\t", "***")):
            ln.log_tail.append(line.rstrip())
    sys.stderr.flush()


def spawn_stage(ln: StageLink, control_port: int, authkey: bytes, advertise: str) -> None:
    """Start stage `ln.index`'s process on this host; its stderr passes through the head's (`forward_log`)."""
    env = {**os.environ, CONTROL_KEY_ENV: authkey.hex()}
    env.pop("XLA_FLAGS", None)  # the stage sets its own device count (the head's is not its)
    cmd = [sys.executable, "-m", "jaxcpp.runtime.stage_process", "--control", f"127.0.0.1:{control_port}",
           "--stage", str(ln.index), "--advertise-address", advertise, "--parent-pid", str(os.getpid())]
    ln.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ln.log_reader = threading.Thread(target=forward_log, args=(ln, ln.process.stderr),
                                     name=f"jaxcpp-stage{ln.index}-log", daemon=True)
    ln.log_reader.start()


def accept_stages(listener: Listener, accepted: queue.SimpleQueue[Any]) -> None:
    """The control listener's loop (a thread): every connection that passes the key check, until closed."""
    while True:
        try:
            accepted.put(listener.accept())
        except OSError:   # closed
            return
        except Exception as e:  # noqa: BLE001 - a bad handshake (wrong key) must not stop accepting
            log.warning("refused a control connection: %s", e)


def stop_stage(ln: StageLink, grace: float) -> None:
    """Tell the stage to stop; a spawned one that has not exited after `grace` seconds is killed."""
    if ln.conn is not None:
        try:
            with ln.send_lock:
                wire.send(ln.conn, {"op": "stop"})
        except OSError:
            pass
    if ln.process is not None:
        try:
            ln.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            ln.process.kill()
            ln.process.wait(timeout=5)
    elif ln.reader is not None:  # another host's: its connection closes when it exits
        ln.reader.join(timeout=grace)
