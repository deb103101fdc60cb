"""Where a PP 2 stage-process prefill spends its time: per-stage forward sums vs wall, and every
micro-batch's probe record (head submit, stage idle/received, pull start, inputs ready, done).

    JAXCPP_PIN_STAGE_CORES=1 JAX_PLATFORMS=cpu .venv/bin/python benchmarks/stage_overlap_probe.py MODEL_DIR

MODEL_DIR: the hidden-256 model that benchmarks/stage_processes.py writes (…/big); same workload as its
speed-up part (two concurrent 4096-token prompts, budget 1024).
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from stage_processes import engine, prompt  # noqa: E402

from jaxcpp import SamplingParams  # noqa: E402


def main() -> None:
    llm = engine(sys.argv[1], max_model_len=4112, max_num_batched_tokens=1024, max_num_seqs=4,
                 pipeline_parallel_size=2, distributed_executor_backend="mp")
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt(1024, 9)], sampling_params=params)  # untimed
    ex = llm.engine.executor
    first = llm.engine.scheduler.num_steps
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt(4096, 1), prompt(4096, 2)], sampling_params=params)
    wall = time.perf_counter() - t0
    timings = [t for t in ex.timings() if t.step_id >= first]
    for s in (0, 1):
        forwards = [t.forward for t in timings if t.stage == s]
        print(f"stage {s}: {len(forwards)} micro-batches, forward sum {sum(forwards):.2f}s")
    print(f"wall {wall:.2f}s")
    keys = ("submitted", "idle_since", "received", "pull_start", "inputs_ready", "done")
    for p in ex.probes():
        if p["id"] >= first:
            print(p["id"], p["stage"], *(f"{k}={p[k] - t0:.3f}" for k in keys))
    llm.engine.close()


if __name__ == "__main__":
    main()
