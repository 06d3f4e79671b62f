"""The plots of `ndtrain report` as PNG bytes (matplotlib, Agg; no window, no global figure state).

`curve`: one or more series against the training step; `pipeline_timeline`: per-rank rows of
forward/backward boxes (drawn by the pipeline's own `write_png`); `bars`: grouped bars, one
group per label, for benchmark comparisons.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ndtrain.parallel.pipeline.timeline import Event, write_png

DPI = 100


@dataclass(frozen=True)
class Series:
    label: str
    steps: list[float]
    values: list[float]
    markers: bool = False  # points joined by lines (sparse series such as validation loss)


def curve(series: list[Series], title: str, ylabel: str, log_y: bool = False) -> bytes:
    """Line plot of every series against step."""
    fig = Figure(figsize=(5.3, 3.2), dpi=DPI)
    ax = fig.add_subplot()
    for s in series:
        ax.plot(s.steps, s.values, "o-" if s.markers else "-", label=s.label, linewidth=1.2, markersize=3)
    if log_y:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def bars(groups: list[str], values: dict[str, list[float | None]], title: str, ylabel: str,
         reference_line: float | None = None) -> bytes:
    """One group of bars per entry of `groups`, one bar per key of `values` (None: no bar)."""
    fig = Figure(figsize=(max(6.4, 0.9 * len(groups) * max(1, len(values)) + 1.5), 3.6), dpi=DPI)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(values))
    for k, (name, heights) in enumerate(values.items()):
        xs = [i + (k - (len(values) - 1) / 2) * width for i, h in enumerate(heights) if h is not None]
        ax.bar(xs, [h for h in heights if h is not None], width, label=name)
    if reference_line is not None:
        ax.axhline(reference_line, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(values) > 1:
        ax.legend(fontsize=8)
    return _png(fig)


def pipeline_timeline(ranks: list[list[Event]], title: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.png"
        write_png(ranks, path, title)
        return path.read_bytes()


def _png(fig: Figure) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
