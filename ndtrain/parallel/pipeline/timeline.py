"""What each pipeline rank did and when: Chrome-trace JSON, a PNG timeline, the bubble fraction.

Each rank records the start and end of every action it runs (compute: F, B, I, W; and the time
spent waiting in RECV_F / RECV_B) on its monotonic clock, taken relative to the exit of a barrier
over the pipeline group at the start of the step (so ranks on one host share a time base to
within the barrier's skew). `gather` collects every rank's events over the pp group (one
all-reduce of one number, one all-gather of 5·E float64 per rank, E = most events on a rank).

Bubble fraction = 1 − Σ_ranks busy / (p · span), busy = time in compute actions, span = first
compute start to last compute end over all ranks: the share of the pipeline's wall time its
ranks spend not computing (theory in `schedules`). The timeline also keeps the peak number of
micro-batches whose activations a rank holds at once (per rank, summed over its chunks).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.pipeline.schedules import COMPUTE

KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_COLORS = {"F": "tab:blue", "B": "tab:green", "I": "tab:olive", "W": "tab:purple", "RECV_F": "0.85", "RECV_B": "0.85"}


@dataclass(frozen=True)
class Event:
    kind: str
    mb: int
    chunk: int
    start: float  # seconds since the step's barrier
    end: float


@dataclass
class Timeline:
    """Pass one to `run_pipeline`; afterwards `events` holds this rank's actions."""

    events: list[Event] = field(default_factory=list)
    peak_live: int = 0  # most micro-batches holding activations at once on this rank
    _origin: float = 0.0

    def start(self, ctx: ParallelContext) -> None:
        self.events.clear()
        self.peak_live = 0
        ctx.comm.barrier(ctx.group("pp"))
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def record(self, kind: str, mb: int, chunk: int, start: float) -> None:
        self.events.append(Event(kind, mb, chunk, start, self.now()))

    def gather(self, ctx: ParallelContext) -> list[list[Event]]:
        """Every pipeline rank's events (same answer on every rank of the pp group)."""
        group = ctx.group("pp")
        count = torch.tensor([len(self.events)], dtype=torch.float64)
        ctx.comm.all_reduce(count, group, op=torch.distributed.ReduceOp.MAX)
        rows = torch.full((int(count.item()), 5), -1.0, dtype=torch.float64)
        for k, e in enumerate(self.events):
            rows[k] = torch.tensor([KINDS.index(e.kind), e.mb, e.chunk, e.start, e.end], dtype=torch.float64)
        everything = torch.empty((group.size * rows.shape[0], 5), dtype=torch.float64)
        ctx.comm.all_gather(everything, rows, group)
        return [
            [Event(KINDS[int(k)], int(mb), int(c), s, e) for k, mb, c, s, e in per_rank.tolist() if k >= 0]
            for per_rank in everything.view(group.size, *rows.shape)
        ]


def bubble_fraction(ranks: list[list[Event]]) -> float:
    """1 − busy / (ranks × span) over the compute events."""
    compute = [[e for e in events if e.kind in COMPUTE] for events in ranks]
    start = min(e.start for events in compute for e in events)
    end = max(e.end for events in compute for e in events)
    busy = sum(e.end - e.start for events in compute for e in events)
    return 1.0 - busy / (len(ranks) * (end - start))


def write_chrome_trace(ranks: list[list[Event]], path: Path) -> None:
    """Trace Event Format (complete events, µs): one thread per pipeline rank; opens in Perfetto."""
    trace = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
        for r in range(len(ranks))
    ]
    for r, events in enumerate(ranks):
        for e in events:
            trace.append({
                "name": f"{e.kind} mb{e.mb}" + (f" c{e.chunk}" if e.chunk else ""), "cat": e.kind, "ph": "X",
                "pid": 0, "tid": r, "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                "args": {"microbatch": e.mb, "chunk": e.chunk},
            })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


def write_png(ranks: list[list[Event]], path: Path, title: str = "") -> None:
    """One row per rank, one box per action labelled micro-batch[.chunk] (matplotlib, Agg); grey: waiting."""
    from matplotlib.figure import Figure  # not pyplot: no global backend, no figure manager

    fig = Figure(figsize=(12, 0.6 * len(ranks) + 1.2))
    ax = fig.subplots()
    for r, events in enumerate(ranks):
        for e in events:
            if e.kind not in _COLORS:
                continue
            ax.barh(r, (e.end - e.start) * 1e3, left=e.start * 1e3, color=_COLORS[e.kind], edgecolor="black", linewidth=0.3)
            if e.kind in COMPUTE:
                label = str(e.mb) if e.chunk == 0 else f"{e.mb}.{e.chunk}"
                ax.text((e.start + e.end) / 2 * 1e3, r, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{title}  bubble {bubble_fraction(ranks):.1%}".strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
