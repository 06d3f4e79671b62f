"""Pipeline schedules in numbers: the bubble each leaves and the micro-batches each keeps in flight.

p stages, m micro-batches per step, v model chunks per stage (interleaved), t_f and t_b the
forward and backward time of one micro-batch on one stage (all its chunks).

Step time of the pipeline part  m·(t_f + t_b) + bubble:
    naive        m·(p−1)·(t_f + t_b)          one micro-batch in the whole pipeline at a time
    gpipe        (p−1)·(t_f + t_b)            Huang 2019 (GPipe); Narayanan 2021 eq. (1)
    1f1b         (p−1)·(t_f + t_b)            Narayanan 2019 (PipeDream-Flush); same bubble as GPipe
    interleaved  (p−1)·(t_f + t_b)/v          Narayanan 2021 §2.2.2
    zb (ZB-H1)   (p−1)·(t_f + t_B − t_W)      Qi 2023 §3, with the backward t_b = t_B + t_W split into
                 = (p−1)·t_f                  input gradient t_B and weight gradient t_W; = (p−1)·t_f
                                              when t_W = t_b/2 (GPUs; a CPU profile measures t_W)
Bubble fraction (GPipe, 1F1B): (p−1)/(m+p−1) of the step.

Activations held on the first stage, in units of one micro-batch through the whole stage:
    naive        1
    gpipe        m                            every forward runs before any backward
    1f1b, zb     min(p, m)                    warm-up depth p (ZB-H1 keeps 1F1B's peak, Qi 2023 §3)
    interleaved  p·(1 + (p−1)/(p·v))          Korthikanti 2022 §4.2.3 (capped at m)
The last stage holds one micro-batch (m for GPipe).
"""

from __future__ import annotations


def bubble_time(schedule: str, p: int, v: int, t_f: float, t_b: float, m: int = 1, t_w: float | None = None) -> float:
    """Idle time of one step; only the naive schedule's depends on the m micro-batches. `t_w`: zb's weight
    pass, part of t_b (half of it when not given)."""
    if p == 1:
        return 0.0
    if schedule == "naive":
        return m * (p - 1) * (t_f + t_b)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (t_f + t_b)
    if schedule == "interleaved":
        return (p - 1) * (t_f + t_b) / v
    if schedule == "zb":  # (p−1)(t_f + t_B − t_W) with t_B = t_b − t_W
        weights = t_b / 2 if t_w is None else t_w
        return (p - 1) * (t_f + t_b - 2 * weights)
    raise ValueError(f"unknown schedule {schedule!r}")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0) -> float:
    """Share of the pipeline time spent idle: bubble / (m·(t_f + t_b) + bubble)."""
    bubble = bubble_time(schedule, p, v, t_f, t_b, m)
    return bubble / (m * (t_f + t_b) + bubble)


def first_stage_in_flight(schedule: str, p: int, m: int, v: int) -> float:
    if p == 1 or schedule == "naive":
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zb"):
        return float(min(p, m))
    if schedule == "interleaved":
        return min(p * (1 + (p - 1) / (p * v)), float(m))
    raise ValueError(f"unknown schedule {schedule!r}")


def last_stage_in_flight(schedule: str, p: int, m: int) -> float:
    return float(m) if (p > 1 and schedule == "gpipe") else 1.0
