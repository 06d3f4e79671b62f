"""What a run leaves in its directory besides checkpoints: metrics.jsonl, loss curve, summary.

`metrics.jsonl` holds one JSON object per logged step (train loss, lr, grad norm, tokens/s, step
time, comm bytes/step, peak memory) or evaluation (val loss), each stamped with its wall-clock
`time`, the run's `elapsed_s` (run_info.RunClock) and, when the trainer gives its epoch length,
`epoch` (fractional: steps done / steps per epoch). On resume, records after the resumed step are
dropped so the file describes exactly one history, and the clock continues from the last kept
record. Each written record is also handed to the sinks (the experiment trackers, run/trackers.py).
`loss.png` plots the losses in the task's unit (nats/byte for the byte tokenizer, nats/token for any
other: run/tasks.py `loss_unit`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from ndtrain.run.info import RunClock


class MetricsLog:
    """Append-only JSON-lines log, truncated to `keep_until_step` when a run resumes."""

    def __init__(self, path: Path, keep_until_step: int, steps_per_epoch: int = 0,
                 sinks: Sequence[Callable[[dict[str, Any]], None]] = ()) -> None:
        self.path = path
        self.steps_per_epoch = steps_per_epoch
        self.sinks = sinks
        kept = [r for r in self.read() if r.get("step", 0) <= keep_until_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.clock = RunClock(max((r.get("elapsed_s", 0.0) for r in kept), default=0.0))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, **self.clock.stamp()}
        if self.steps_per_epoch and "step" in record:
            record["epoch"] = record["step"] / self.steps_per_epoch
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink(record)


def plot_loss_curve(records: list[dict[str, Any]], png: Path, title: str, loss_unit: str, outputs: int = 0) -> None:
    """Train and validation loss (in `loss_unit`, e.g. nats/token) against step, written as a PNG; with
    `outputs` > 0, a dotted line at ln(outputs), the loss of a uniform guess among that many values."""
    from matplotlib.figure import Figure  # not pyplot: no global backend, no figure manager, ~0.25 s less per run

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=3)
    if outputs > 0:
        ax.axhline(math.log(outputs), color="grey", linestyle=":", linewidth=1, label=uniform_label(loss_unit, outputs))
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({loss_unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def uniform_label(loss_unit: str, outputs: int) -> str:
    """The legend of the uniform-guess line, e.g. 'ln 200 (uniform over 200 tokens)' for nats/token."""
    return f"ln {outputs} (uniform over {outputs} {loss_unit.partition('/')[2] or 'value'}s)"


def format_table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
    return f"{title}\n{body}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
