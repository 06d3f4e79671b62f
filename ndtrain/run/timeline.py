"""One training step's pipeline timeline, recorded by the trainer into RUN_DIR/timeline.json.

Opt-in with `log.timeline` (pipeline runs only, pp > 1): `true` records step 2 (the first step
after the one-time costs of step 1; step 1 when the run has one step), an integer N records
step N. During that step the engine's pipeline runner records every action of this rank
(`parallel/pipeline/timeline.py`: one barrier over the pp group at the step's start, inside the
timed step); afterwards every pp group gathers its events (one all-reduce of one number and one
all-gather of 5·E float64 per rank, outside the timed step) and rank 0 writes its group's
timeline as plain JSON:

    {"format": "ndtrain-timeline", "version": 1, "step": N, "schedule": "1f1b", "pp": p,
     "virtual": v, "bubble_fraction": b,
     "ranks": [[{"kind": "F", "mb": 0, "chunk": 0, "start": s, "end": e}, ...], ...]}

(times in seconds since the step's barrier, one list per pipeline rank). `read_timeline` reads it
back as `Event` lists for `ndtrain report`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ndtrain.config import TrainConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.pipeline.timeline import KINDS, Event, Timeline, bubble_fraction

if TYPE_CHECKING:  # the report reads timelines without building engines
    from ndtrain.engine import Engine

FORMAT, VERSION = "ndtrain-timeline", 1
FILE_NAME = "timeline.json"


def timeline_step(cfg: TrainConfig) -> int | None:
    """The step (1-based) whose timeline `log.timeline` asks for, or None; a UserError when it cannot be had."""
    wanted = cfg.log.timeline
    if wanted is False:
        return None
    if cfg.parallel.pp == 1:
        raise UserError(
            f"log.timeline={_toml(wanted)} records a pipeline timeline: it needs parallel.pp > 1 (--pp), "
            "or set log.timeline=false"
        )
    step = min(2, cfg.schedule.steps) if wanted is True else wanted
    if step > cfg.schedule.steps:
        raise UserError(
            f"log.timeline={wanted} is after the run's last step {cfg.schedule.steps}: "
            f"give a step in 1..{cfg.schedule.steps} or true"
        )
    return step


class TimelineRecorder:
    """Arms the engine's pipeline timeline for one step and writes what it recorded."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, run_dir: Path) -> None:
        self.step = timeline_step(cfg)
        self.ctx, self.path = ctx, run_dir / FILE_NAME
        self.schedule, self.virtual = cfg.parallel.pp_schedule, cfg.parallel.pp_virtual

    def before(self, step: int, engine: Engine) -> None:
        """Call before training step `step` (1-based)."""
        if step == self.step:
            engine.timeline = Timeline()

    def after(self, step: int, engine: Engine) -> None:
        """Call after training step `step` on every rank: gathers the pp group's events; rank 0 writes them."""
        if step != self.step or engine.timeline is None:
            return
        ranks = engine.timeline.gather(self.ctx)
        engine.timeline = None
        if self.ctx.is_main:
            write_timeline(self.path, ranks, step, self.schedule, self.virtual)


def write_timeline(path: Path, ranks: list[list[Event]], step: int, schedule: str, virtual: int) -> None:
    data = {
        "format": FORMAT, "version": VERSION, "step": step, "schedule": schedule, "pp": len(ranks),
        "virtual": virtual, "bubble_fraction": bubble_fraction(ranks),
        "ranks": [[{"kind": e.kind, "mb": e.mb, "chunk": e.chunk, "start": e.start, "end": e.end} for e in events]
                  for events in ranks],
    }
    path.write_text(json.dumps(data) + "\n")


def read_timeline(path: Path) -> tuple[dict[str, Any], list[list[Event]]]:
    """(the file's header fields, every rank's events); a UserError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format is not {FORMAT!r}")
        ranks = [[Event(str(e["kind"]), int(e["mb"]), int(e["chunk"]), float(e["start"]), float(e["end"]))
                  for e in events] for events in data["ranks"]]
        if not ranks or any(e.kind not in KINDS for events in ranks for e in events):
            raise ValueError("no ranks, or an unknown action kind")
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"{str(path)!r} is not a pipeline timeline written by ndtrain ({e}): delete it or re-run "
                        "with log.timeline") from None
    header = {k: v for k, v in data.items() if k != "ranks"}
    return header, ranks


def _toml(value: bool | int) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
