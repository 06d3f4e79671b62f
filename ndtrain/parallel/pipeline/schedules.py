"""Pipeline schedules as data: for every rank, the ordered list of actions it performs in one step.

Symbols: p pipeline ranks, v virtual stages (model chunks) per rank, m micro-batches, S = p·v
stages. Rank r holds chunks c = 0..v−1, which are stages s = c·p + r (Megatron's interleaving;
v = 1 is the plain pipeline). Each schedule is a pure function of (p, m, v) returning, per rank,
its compute actions:

    F(i, c)  forward of micro-batch i on chunk c
    B(i, c)  full backward (input and weight gradients) of micro-batch i on chunk c
    I(i, c)  backward to the input only (zb)          W(i, c)  backward to the weights only (zb)

`with_communication` then inserts the point-to-point actions around them: RECV_F before a
forward whose input comes from another rank, SEND_F after a forward whose output goes to one,
and RECV_B / SEND_B likewise for the gradient flowing back. The runner executes exactly these
lists. Bubble fraction with equal per-micro-batch costs (t_F, t_B, t_W):

    naive        (p−1)/p                           one micro-batch in the whole pipeline at a time
    gpipe, 1f1b  (p−1)/(m+p−1)                     activations in flight per rank: m vs ≤ p − r
    interleaved  (p−1)/(v·m+p−1)                   needs m % p == 0
    zb (ZB-H1)   (p−1)(t_F+t_B−t_W) / (m(t_F+t_B+t_W) + (p−1)(t_F+t_B−t_W))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ndtrain.errors import UserError
from ndtrain.config.options import PP_SCHEDULES as SCHEDULES
from ndtrain.config.options import PipelineSchedule
COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
    mb: int
    chunk: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}.{self.chunk}"


def check(schedule: str, p: int, m: int, v: int) -> None:
    """UserError for a combination the schedule cannot run (before anything is communicated)."""
    if schedule not in SCHEDULES:
        raise UserError(f"pipeline schedule {schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
    if m < 1:
        raise UserError(f"pipeline needs at least one micro-batch, got m={m}")
    if v != 1 and schedule != "interleaved":
        raise UserError(f"virtual stages v={v} need schedule 'interleaved' (got {schedule!r}): set v=1")
    if schedule in ("1f1b", "zb") and m < p:
        raise UserError(f"schedule {schedule!r} needs m >= p micro-batches, got m={m} < p={p}: raise m")
    if schedule == "interleaved" and m % p:
        raise UserError(f"schedule 'interleaved' needs m a multiple of p={p}, got m={m}: use m={p * (m // p + 1)}")


def compute_actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The compute actions of every rank (index = pipeline rank)."""
    check(schedule, p, m, v)
    return [_RANK_SCHEDULES[schedule](r, p, m, v) for r in range(p)]


def forward_actions(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Evaluation: every forward, chunk by chunk, micro-batches in order (nothing to keep for a backward)."""
    if m < 1:
        raise UserError(f"pipeline needs at least one micro-batch, got m={m}")
    return [[Action("F", i, c) for c in range(v) for i in range(m)] for _ in range(p)]


def _naive(r: int, p: int, m: int, v: int) -> list[Action]:
    return [a for i in range(m) for a in (Action("F", i, 0), Action("B", i, 0))]


def _gpipe(r: int, p: int, m: int, v: int) -> list[Action]:
    return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int, v: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    out = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i, 0), Action("B", i, 0)]
    return out + [Action("B", i, 0) for i in range(m - warmup, m)]


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of p."""
    total = m * v

    def order(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    if v == 1:
        warmup = min(p - r - 1, total)
    elif m == p:
        warmup = total
    else:
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [Action("F", *order(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        out += [Action("F", *order(warmup + k, False)), Action("B", *order(k, True))]
    return out + [Action("B", *order(k, True)) for k in range(total - warmup, total)]


def _zero_bubble_h1(r: int, p: int, m: int, v: int) -> list[Action]:
    """ZB-H1: 1F1B with the backward split; rank r runs its weight passes r slots late, so the
    input gradients reach the first stage sooner and the deferred W passes fill the cooldown.
    Activations are kept until W: p − r − 1 + 1 + r = p micro-batches on every rank at most."""
    warmup = min(p - r - 1, m)
    out = [Action("F", i, 0) for i in range(warmup)]
    weights = 0
    for i in range(m - warmup):
        out += [Action("F", warmup + i, 0), Action("I", i, 0)]
        if i >= r:
            out.append(Action("W", weights, 0))
            weights += 1
    for j in range(m - warmup, m):
        out.append(Action("I", j, 0))
        if weights <= j:
            out.append(Action("W", weights, 0))
            weights += 1
    return out + [Action("W", k, 0) for k in range(weights, m)]


_RANK_SCHEDULES: dict[PipelineSchedule, Callable[[int, int, int, int], list[Action]]] = {
    "naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb": _zero_bubble_h1,
}


def stage_of(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def place(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) holding a stage."""
    return stage % p, stage // p


def with_communication(compute: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Insert RECV before and SEND after each compute action whose neighbour stage is on another rank."""
    last = p * v - 1
    out = []
    for r, actions in enumerate(compute):
        full: list[Action] = []
        for a in actions:
            s = stage_of(r, a.chunk, p)
            if a.kind == "F":
                if s > 0 and place(s - 1, p)[0] != r:
                    full.append(Action("RECV_F", a.mb, a.chunk))
                full.append(a)
                if s < last and place(s + 1, p)[0] != r:
                    full.append(Action("SEND_F", a.mb, a.chunk))
            elif a.kind in ("B", "I"):
                if s < last and place(s + 1, p)[0] != r:
                    full.append(Action("RECV_B", a.mb, a.chunk))
                full.append(a)
                if s > 0 and place(s - 1, p)[0] != r:
                    full.append(Action("SEND_B", a.mb, a.chunk))
            else:
                full.append(a)
        out.append(full)
    return out


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's full action list (compute and communication)."""
    return with_communication(compute_actions(schedule, p, m, v), p, v)


Product = tuple[str, int, int]  # ("F", mb, stage): that stage's output; ("G", mb, stage): the gradient of its input


def inputs_of(a: Action, stage: int, last: int) -> list[Product]:
    """What compute action `a` on `stage` waits for: a forward for the previous stage's output, a
    backward (B, I) for its own forward and the next stage's input gradient, W for its own I."""
    if a.kind == "F":
        return [("F", a.mb, stage - 1)] if stage > 0 else []
    if a.kind in ("B", "I"):
        return [("F", a.mb, stage)] + ([("G", a.mb, stage + 1)] if stage < last else [])
    return [("G", a.mb, stage)]


def output_of(a: Action, stage: int) -> Product | None:
    """What compute action `a` on `stage` makes for others: F its output, B and I its input gradient."""
    return None if a.kind == "W" else ("F" if a.kind == "F" else "G", a.mb, stage)


def simulate(
    compute: list[list[Action]], p: int, v: int, cost: Callable[[str, int], float],
) -> list[list[tuple[float, float]]]:
    """Start/end of every compute action when each rank runs its list in order and an action
    starts once its inputs exist (zero-cost communication); `cost(kind, stage)` is an action's
    duration. Raises RuntimeError on a deadlock."""
    last = p * v - 1
    finish: dict[Product, float] = {}  # when each product exists
    clock, pos = [0.0] * p, [0] * p
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    while any(pos[r] < len(compute[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(compute[r]):
                a = compute[r][pos[r]]
                s = stage_of(r, a.chunk, p)
                deps = inputs_of(a, s, last)
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                clock[r] = start + cost(a.kind, s)
                times[r].append((start, clock[r]))
                made = output_of(a, s)
                if made is not None:
                    finish[made] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at positions {pos}")
    return times


def bubble_fraction(times: list[list[tuple[float, float]]]) -> float:
    """1 − busy / (ranks × span): the idle share of the pipeline's wall time."""
    start = min(t[0][0] for t in times if t)
    end = max(t[-1][1] for t in times if t)
    busy = sum(e - s for t in times for s, e in t)
    return 1.0 - busy / (len(times) * (end - start))
