"""Where a `jaxcpp serve` process's threads spend a vs-vLLM serving cell: py-spy samples by thread.

Starts `jaxcpp serve` as `benchmarks/vs_vllm.py` does (OpenAI API, its flags), drives it with vLLM's own
client (so it needs the vLLM venv `vs_vllm.py --setup` makes): one warm-up pass, one plain pass, then a
pass under `py-spy record --threads --idle` (py-spy from `--py-spy`, e.g. a venv of its own; it slows
the server, so the plain pass is the figure to compare with vLLM). Prints both passes' metrics and, per
thread, the samples it was busy and the samples it waited (in `select`, a condition, a queue, or for the
device), with the busy samples' leading frames.

    .venv/bin/python benchmarks/serving_threads.py --model tiny --workload mixed --concurrency 64 \
        --py-spy /tmp/pyspy-venv/bin/py-spy
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import vs_vllm

WAITS = ("EpollSelector.select", "Condition.wait", "_run_commands", "try_to_block", "block_until_ready (jax",
         "TimingRecorder._watch")  # a sample whose innermost frame is one of these: the thread waits


def threads(raw: Path) -> dict[str, tuple[int, int, Counter]]:
    """py-spy's raw output -> thread: (busy samples, waiting samples, the busy samples' innermost frames)."""
    out: dict[str, tuple[int, int, Counter]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        busy, waited, leaves = out.get(frames[0], (0, 0, Counter()))
        if any(w in frames[-1] for w in WAITS):
            waited += n
        else:
            busy += n
            leaves[frames[-1]] += n
        out[frames[0]] = (busy, waited, leaves)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=("tiny", "30m", "300m"))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/vsv"))
    a = p.parse_args()
    args = vs_vllm.parse_args(["--models", a.model, "--workloads", a.workload, "--concurrency",
                               str(a.concurrency), "--max-num-batched-tokens", "512", "--max-model-len", "1280",
                               "--work-dir", str(a.work_dir)])
    model = vs_vllm.write_model(a.model, a.work_dir / "models")
    work = Path(tempfile.mkdtemp(prefix="serving-threads-"))
    prompts = vs_vllm.num_prompts(args, a.concurrency)
    server = vs_vllm.start("jaxcpp", model, args, work / "server.log")
    try:
        vs_vllm.bench(server, model, a.workload, a.concurrency, prompts, 10_000, args, work / "warm.json")
        for seed, label in ((0, "plain"), (1, "under py-spy")):
            spy = None
            if seed:
                spy = subprocess.Popen([a.py_spy, "record", "--pid", str(server.proc.pid), "--threads", "--idle",
                                        "--format", "raw", "--rate", "200", "-o", str(work / "spy.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            res = vs_vllm.bench(server, model, a.workload, a.concurrency, prompts, seed, args, work / f"{seed}.json")
            print(f"{label}: " + "  ".join(f"{lab} {res[key]:.1f}" for key, lab, _ in vs_vllm.METRICS), flush=True)
            if spy is not None:
                spy.send_signal(2)
                spy.wait(60)
    finally:
        server.stop()
    for thread, (busy, waited, leaves) in threads(work / "spy.txt").items():
        print(f"{thread}: busy {busy} samples, waiting {waited}")
        for frame, n in leaves.most_common(4):
            print(f"    {n:6d}  {frame}")
    print(f"logs and samples in {work}")


if __name__ == "__main__":
    main()
