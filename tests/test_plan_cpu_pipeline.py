"""The processor-sharing simulation of a pipeline schedule (plan/cpu_pipeline.py), against makespans
worked out by hand for 1F1B on two ranks (f = 1 s forward, b = 2 s backward per micro-batch)."""

from __future__ import annotations

import pytest

from ndtrain.parallel.pipeline.schedules import Action, compute_actions
from ndtrain.plan.cpu_pipeline import Slots, Work, makespan


def one_f_one_b(slots: Slots, comm: float = 0.0, m: int = 2) -> float:
    def cost(action: Action, stage: int) -> Work:
        return Work(1.0 if action.kind == "F" else 2.0, comm)

    return makespan(compute_actions("1f1b", 2, m), 2, 1, cost, slots)


def test_with_a_slot_per_rank_the_schedule_runs_as_on_dedicated_cores() -> None:
    assert one_f_one_b(Slots(1, 2, 1.0)) == pytest.approx((2 + 2 - 1) * 3)  # (m + p − 1)(f + b)


def test_one_slot_is_never_idle_while_a_rank_can_compute() -> None:
    """Some rank can always compute here, so one slot does all 2·m·(f + b) seconds of work back to back."""
    assert one_f_one_b(Slots(1, 1, 1.0)) == pytest.approx(12.0)
    assert one_f_one_b(Slots(1, 1, 1.0), m=4) == pytest.approx(24.0)


def test_sharing_slows_only_the_processes_that_share() -> None:
    """Sharing 1.5, one slot. Rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1. F0 alone (0–1); F1 ‖ F0 at 1/3
    (1–4); rank 1's B0 alone (4–6); B0 ‖ F1 at 1/3: F1 done at 9, B0 half; B0 ‖ B1 at 1/3: B0 done at
    12, B1 half; B1 alone (12–13); rank 0's B1 alone (13–15)."""
    assert one_f_one_b(Slots(1, 1, 1.5)) == pytest.approx(15.0)


def test_replicas_count_as_processes() -> None:
    """Two replicas per rank on two slots share as one replica on one slot does."""
    assert one_f_one_b(Slots(2, 2, 1.0)) == pytest.approx(one_f_one_b(Slots(1, 1, 1.0)))


def test_communication_takes_wall_time_and_holds_its_slot() -> None:
    """0.5 s of communication after each action. On a slot per rank: the critical path is rank 0's F0, rank
    1's F0 B0 F1 B1, rank 0's B1 — 6 actions, so 9 s + 6 × 0.5 s. On one slot a rank communicating still
    holds its share (the profile's collective costs were measured with every process busy): F0 + its
    send (0–1.5); F1 ‖ F0 at 1/2, then both sends (1.5–4); rank 1's B0 + send (4–6.5); B0 ‖ F1 at 1/2 until
    F1 is done (8.5), B0 ‖ F1's send (to 9, B0 0.75 left), B0 ‖ B1 (to 10.5, B1 1.25 left), B0's send ‖ B1
    (to 11, B1 1 left), B1 alone + send (to 12.5), rank 0's B1 + send (to 15)."""
    assert one_f_one_b(Slots(1, 2, 1.0), comm=0.5) == pytest.approx(9.0 + 6 * 0.5)
    assert one_f_one_b(Slots(1, 1, 1.0), comm=0.5) == pytest.approx(15.0)
