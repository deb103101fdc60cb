"""A stage process's set-up, before and around its `StageWorker` (`jaxcpp.runtime.stage_process`): the
head's control channel, its devices and cores (before jax is imported), its parent and Ctrl-C, the
head watched while it starts, the jax.distributed coordinator, its neighbours, the compilation cache.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any

from jaxcpp.pipe import wire
from jaxcpp.pipe.cluster import check_reachable, is_loopback, split_host_port

log = logging.getLogger("jaxcpp.stage")

CONNECT_TIMEOUT_S = float(os.environ.get("JAXCPP_STAGE_CONNECT_TIMEOUT_S", "600"))
COORDINATOR_WAIT_S = 120.0   # a later stage may start well before stage 0's process hosts the coordinator



def connect(address: tuple[str, int], authkey: bytes, parent_pid: int | None) -> Any:
    """The head's control channel; retried while the head starts (multi-host hosts start in any order)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, OSError) as e:
            if time.monotonic() > deadline or (parent_pid is not None and os.getppid() != parent_pid):
                raise ConnectionError(f"no head at {address[0]}:{address[1]}: {e}") from e
            time.sleep(0.2)


def configure_process(num_devices: int, cores: list[int] | None) -> None:
    """Before jax is imported: this stage's T devices (on CPU) and, when it will be pinned to its own
    cores (`pin_to_cores`), single-threaded XLA:CPU, so that stages really run side by side."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={num_devices}"
    if cores and "xla_cpu_multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["XLA_FLAGS"] = flags.strip()


def pin_to_cores(cores: list[int], pid: int | str = "self") -> None:
    """Every thread of process `pid` (this one by default), and so every thread it starts later, on
    `cores` only."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def run_forwards_inline_on_cores(cores: list[int]) -> None:
    """A pinned stage: computations run on the calling thread, the client's pool serves the transfers.

    XLA:CPU sizes its client thread pool from the cores the process may use when the client is
    created, and with async dispatch that pool runs both the computations and the transfer server's
    sends. One thread (pinned first) and the send of micro-batch k waited behind the forward of k + 1;
    a thread per machine core (pinned after) and the send went through, but the forwards, split over
    threads time-sharing one core, took 30-40% longer than the same layers in one process. So: pinned
    before the client exists (a one-thread pool) and async dispatch off (the forward runs inline on
    this stage's own thread, which waits for it anyway): the pool's thread is free for sends, and the
    forward has the core to itself. Before jax's client exists, i.e. before any jax.devices().
    """
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    pin_to_cores(cores)
    jax.devices()


def watch_parent(parent_pid: int) -> None:
    """A spawned stage exits as soon as its head is gone, even while blocked on a transfer."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        os._exit(3)

    threading.Thread(target=run, name="jaxcpp-parent-watch", daemon=True).start()


def leave_ctrl_c_to_the_head(stage: int, spawned: bool) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole process group, the stages a head spawned included.
    Those leave it to the head, which drains and then stops every stage in order (stage 0, the
    coordinator's host, last); a stage started on its own host ends at once with one line. Either way no
    KeyboardInterrupt traceback from wherever the main thread was blocked (the control channel's recv)."""
    if spawned:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return

    def interrupted(signum: int, frame: Any) -> None:
        print(f"jaxcpp stage {stage}: interrupted (SIGINT); exiting", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted)


def watch_head_while_starting(conn: Any, stage: int) -> tuple[threading.Event, queue.SimpleQueue[dict[str, Any]]]:
    """Until this stage says ready the head sends nothing but its sizing (handed over through the returned
    queue) or `stop`, so anything else readable (or a closed channel) means the head gave up: exit rather
    than wait on a peer or a barrier that never comes. Set the returned event just before sending ready
    (or an error)."""
    ready = threading.Event()
    sizing: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def run() -> None:
        while not ready.is_set():
            try:
                if not conn.poll(0.25) or ready.is_set():
                    continue
                header = wire.recv(conn)[0]
            except (EOFError, OSError):
                header = {"op": "closed"}
            if header["op"] == "sizing":
                sizing.put(header["sizing"])
                continue
            stopped = header["op"] == "stop"
            log.error("stage %d: the head %s during start-up; exiting", stage,
                      "stopped the pipeline" if stopped else "closed the control channel")
            os._exit(0 if stopped else 1)

    threading.Thread(target=run, name="jaxcpp-start-watch", daemon=True).start()
    return ready, sizing


def write_own_cache_entries() -> None:
    """Let this stage write its programs to the persistent compilation cache. jax writes entries from
    process 0 only (SPMD processes compile the same programs: one writer is enough), but a pipeline's
    stages compile each their own (MPMD), so a stage > 0 found none of its programs on a warm start and
    compiled every bucket again (PP 2: stage 0 "loaded bucket i/n from the compilation cache" in 3 s,
    stage 1 "compiled bucket i/n" in 22 s). That check reads jax.distributed's process id when it writes;
    the only other readers are the backend's creation (done: call this after it) and computations that
    span processes (a stage's never do)."""
    from jax._src import distributed

    distributed.global_state.process_id = 0


def neighbours(index: int, num_stages: int) -> list[int]:
    """The stages whose transfer servers this one exchanges with: the next and previous stages, and
    the first and last (fed-back tokens); jax's transport connects both ways between them."""
    last = num_stages - 1
    peers = {index - 1, index + 1} | ({last} if index == 0 else set()) | ({0} if index == last else set())
    return sorted(p for p in peers if 0 <= p < num_stages and p != index)


def join_coordinator(coordinator: str, my_ip: str, index: int, num_stages: int, heartbeat_timeout_s: int) -> None:
    """jax.distributed.initialize, with its failures named: stage 0's process hosts the service, a later
    stage first checks that it can reach it (else jax waits minutes, then aborts the process).

    The service's failure detector aborts every stage when one sends no heartbeat for
    `heartbeat_timeout_s` (--distributed-heartbeat-timeout-s). At 10 s it was the failure: a PP 2 server
    warming up beside other CPU-heavy work was aborted ("tasks are unhealthy (stopped sending
    heartbeats)"), both stages SIGABRT. A dead stage is noticed by its control connection instead, within
    milliseconds; this timeout only catches a stage that hangs without dying."""
    import jax

    if index > 0:
        check_reachable(my_ip, coordinator, "the jax.distributed coordinator", wait_s=COORDINATOR_WAIT_S)
    # jax binds the service to every interface; on one host nothing outside it needs to reach it
    bind = coordinator if is_loopback(split_host_port(coordinator)[0]) else None
    try:
        jax.distributed.initialize(coordinator, num_processes=num_stages, process_id=index,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s, coordinator_bind_address=bind)
    except Exception as e:  # noqa: BLE001 - jax raises its runtime's errors; name the coordinator
        raise ConnectionError(f"jax.distributed.initialize (process {index} of {num_stages}) with the "
                              f"coordinator at {coordinator} failed: {e}") from e
