"""A pipeline step on a CPU whose processes outnumber its compute slots: a processor-sharing simulation.

With P processes on S < P slots (`cpu_profile`), the planner's bound "a step takes at least
sharing · (all processes' compute) / S" assumes every process always has work. A pipeline's ranks do
not: in its warm-up and cool-down, and while a stage waits for its neighbour, fewer processes are
runnable than there are slots, and a core idles (pp4 on 2 slots at 4 micro-batches: 13 % longer than
the bound). This module runs ndtrain's own schedule (the action lists `parallel/pipeline/schedules.py`
hands the runner) on S shared slots instead.

Model: pipeline rank r stands for its n = dp·cp·tp peers, which run the same actions in step. An
action is its compute (seconds on a slot of its own, as the profile measured it) followed by its
communication (seconds of wall time). It starts when its rank's previous action is done and its
inputs exist (`schedules.inputs_of`). While R processes are in an action, each one computing
progresses at rate 1 if R ≤ S, else S / (R · sharing) (`sharing` ≥ 1: what sharing the cores costs
beyond splitting them, measured by the calibration); one communicating counts in R but its time
passes at rate 1, since the profile measured each collective's cost as the wall time it adds while
every process computes between collectives (`calibrate_comm.py`). A rank waiting for its inputs
holds no slot. Cost: one event per action start or phase end, O(p) work each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ndtrain.parallel.pipeline.schedules import Action, Product, inputs_of, output_of, stage_of


@dataclass(frozen=True)
class Work:
    compute: float  # seconds on a slot of its own
    comm: float  # seconds of wall time after it, holding no slot


@dataclass(frozen=True)
class Slots:
    replicas: int  # processes per pipeline rank (its dp·cp·tp peers, in step)
    slots: int  # processes that can compute at once
    sharing: float  # slowdown beyond R/S when R > S processes compute

    def rate(self, busy_ranks: int) -> float:
        """Progress per second of each computing process while `busy_ranks` pipeline ranks are in an action."""
        running = self.replicas * busy_ranks
        return 1.0 if running <= self.slots else self.slots / (running * self.sharing)


def makespan(actions: list[list[Action]], p: int, v: int, cost: Callable[[Action, int], Work], slots: Slots) -> float:
    """Seconds from the first action's start to the last one's end: `actions[r]` is rank r's compute
    actions in order, `cost(action, stage)` what one costs. RuntimeError on a deadlock."""
    last = p * v - 1
    made: set[Product] = set()
    pos = [0] * p
    phase: list[str | None] = [None] * p  # "compute", "comm" or None (waiting or done)
    left = [0.0] * p
    work = [Work(0.0, 0.0)] * p  # of each rank's current action
    now = 0.0
    while True:
        for r in range(p):
            if phase[r] is None and pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                stage = stage_of(r, a.chunk, p)
                if all(d in made for d in inputs_of(a, stage, last)):
                    work[r] = cost(a, stage)
                    phase[r], left[r] = "compute", work[r].compute
        active = [r for r in range(p) if phase[r] is not None]
        if not active:
            if any(pos[r] < len(actions[r]) for r in range(p)):
                raise RuntimeError(f"schedule deadlocks at positions {pos}")
            return now
        rate = slots.rate(len(active))
        speed = {r: rate if phase[r] == "compute" else 1.0 for r in active}
        step = min(left[r] / speed[r] for r in active)
        now += step
        for r in active:
            left[r] -= step * speed[r]
            if left[r] > 1e-12 * max(1.0, step):
                continue
            if phase[r] == "compute":
                phase[r], left[r] = "comm", work[r].comm
                if left[r] > 0.0:
                    continue
            a = actions[r][pos[r]]
            product = output_of(a, stage_of(r, a.chunk, p))
            if product is not None:
                made.add(product)
            pos[r], phase[r] = pos[r] + 1, None
