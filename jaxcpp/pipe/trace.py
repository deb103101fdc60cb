"""`--trace-file out.json`: the pipeline's timing probes as a Chrome/Perfetto trace.

One row (thread) per stage, one complete event ("ph": "X") per step and stage spanning its forward
(see `jaxcpp.runtime.timing`), so the pipeline and its bubbles are the gaps between boxes. Below them
a "host" row holds the engine loop's phases of every step (schedule, build, dispatch, wait,
postprocess; `jaxcpp.core.executor.HostPhase`) and the garbage collector's pauses ("gc"), so a reader
sees which gaps the host caused. Both rows name a step by the scheduler's step id ("step 12").
Open the file in https://ui.perfetto.dev or chrome://tracing.

Events are streamed as the watcher threads produce them, in the JSON Array Format, whose closing `]`
the viewers do not require: a run that is killed still leaves a readable trace. `close()` (also run at
interpreter exit) writes the `]`, so a finished file is plain JSON.
"""

from __future__ import annotations

import atexit
import json
import threading
from pathlib import Path
from typing import IO, Any

from jaxcpp.core.executor import HostPhase, StageTiming

FLUSH_EVERY = 64  # events; the file is also flushed on close


class TraceWriter:
    def __init__(self, path: str | Path, origin: float, stage_names: list[str]) -> None:
        """`origin`: the perf_counter() reading that becomes timestamp 0."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._origin = origin
        self._lock = threading.Lock()
        self._unflushed = 0
        self._file: IO[str] | None = open(self.path, "w")  # noqa: SIM115 (closed in close())
        self._file.write("[\n")
        self._write({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "jaxcpp pipeline"}},
                    first=True)
        self._host_row = len(stage_names)
        for row, name in enumerate([*stage_names, "host: engine loop"]):
            self._write({"ph": "M", "pid": 0, "tid": row, "name": "thread_name", "args": {"name": name}})
            self._write({"ph": "M", "pid": 0, "tid": row, "name": "thread_sort_index",
                         "args": {"sort_index": row}})
        atexit.register(self.close)

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def add(self, t: StageTiming) -> None:
        """One stage's forward of one step (thread-safe; called from the watcher threads)."""
        self._write({
            "ph": "X", "pid": 0, "tid": t.stage, "cat": "forward",
            "name": f"step {t.step_id} ({t.num_tokens_padded} tok)",
            "ts": self._us(t.start), "dur": round(t.forward * 1e6, 3),
            "args": {"step": t.step_id, "stage": t.stage, "num_tokens_padded": t.num_tokens_padded,
                     "dispatched_us": self._us(t.dispatched), "inputs_ready_us": self._us(t.inputs_ready)},
        })

    def add_host(self, phase: HostPhase) -> None:
        self._write({"ph": "X", "pid": 0, "tid": self._host_row, "cat": "host",
                     "name": f"{phase.name} {phase.step}", "ts": self._us(phase.start),
                     "dur": round((phase.end - phase.start) * 1e6, 3),
                     "args": {"phase": phase.name, "step": phase.step}})

    def _write(self, event: dict[str, Any], first: bool = False) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(("" if first else ",\n") + json.dumps(event))
            self._unflushed += 1
            if self._unflushed >= FLUSH_EVERY:
                self._file.flush()
                self._unflushed = 0

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]\n")
            self._file.close()
            self._file = None
        atexit.unregister(self.close)
