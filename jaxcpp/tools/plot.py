"""Pipeline timelines, side by side: one panel per plan, one row per stage, one box per chunk.

matplotlib is imported inside the function only, so nothing else in the package needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.core.executor import StageTiming
from jaxcpp.tools.simulator import SimResult, StageSpan


def plot_timelines(results: Mapping[str, SimResult], path: str | Path, title: str = "") -> None:
    """Write a PNG with a Gantt chart per named simulation, sharing the time axis."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 3.2), sharex=True, squeeze=False)
    colours = plt.get_cmap("tab20")
    for ax, name in zip(axes[0], names, strict=True):
        result = results[name]
        stages = 1 + max(span.stage for span in result.spans)
        for span in result.spans:
            ax.broken_barh([(span.start, span.end - span.start)], (span.stage - 0.4, 0.8),
                           facecolors=colours(span.batch % 20), edgecolors="black", linewidth=0.3)
            if span.stage == 0:
                ax.text(span.start + (span.end - span.start) / 2, -0.5, str(span.pieces[0][2]),
                        ha="center", va="bottom", fontsize=5, rotation=90)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.set_ylim(stages - 0.5, -1.6)  # inverted: stage 0 on top, chunk sizes above it
        ax.set_xlabel("time (s)")
        ax.set_title(f"{name}: TTFT {result.mean_ttft:.6g} s, {len(result.spans) // stages} chunks",  # as the table
                     fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_measured_vs_predicted(timings: Sequence[StageTiming], model: LatencyModel, chunks: Sequence[int],
                               num_stages: int, path: str | Path, title: str = "",
                               stage_weights: Sequence[float] | None = None) -> None:
    """One lone prompt's stage boxes as the stages timed them, beside the boxes `model` predicts for the
    same chunks (stage s starts chunk k once stage s - 1 finished k and stage s finished k - 1)."""
    t0 = min(t.start for t in timings)
    first = min(t.step_id for t in timings)
    measured = SimResult(ttft={"lone": max(t.done for t in timings) - t0},
                         spans=[StageSpan(t.step_id - first, t.stage, t.start - t0, t.done - t0,
                                          (("lone", 0, t.num_tokens_padded),)) for t in timings])
    weights = stage_weights or (1.0,) * num_stages
    done = [[0.0] * len(chunks) for _ in weights]
    spans, prefix = [], 0
    for k, chunk in enumerate(chunks):
        seconds = float(model.predict(prefix, chunk))
        for s, weight in enumerate(weights):
            start = max(done[s - 1][k] if s else 0.0, done[s][k - 1] if k else 0.0)
            done[s][k] = start + seconds * weight
            spans.append(StageSpan(k, s, start, done[s][k], (("lone", prefix, chunk),)))
        prefix += chunk
    predicted = SimResult(ttft={"lone": done[-1][-1]}, spans=spans)
    plot_timelines({"measured (stage processes)": measured, "predicted (latency model)": predicted}, path,
                   title=title)
