"""What `ctx.comm` counted between two `stats.snapshot()`s (per "op/axis", the calls and bytes added), and
engine steps with what each counted."""

from __future__ import annotations

from typing import Any

from ndtrain.dist.mesh import ParallelContext
from tests.helpers.models import micro_batches

Snapshot = dict[str, dict[str, int]]


def counted_since(before: Snapshot, after: Snapshot) -> Snapshot:
    """The operations whose counts changed, each with its fields' increase (calls, payload and wire bytes)."""
    return {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v} for k, v in after.items() if v != before.get(k)}


def train_counted(engine: Any, ctx: ParallelContext, steps: int, accumulation: int) -> tuple[list[float], list[Snapshot]]:
    """`steps` engine steps on `micro_batches` (this rank's share, `accumulation` micro-batches each):
    the gradient norm of each and what each step counted."""
    norms, deltas = [], []
    for step in range(steps):
        before = ctx.comm.stats.snapshot()
        result = engine.train_step(micro_batches(step, ctx.rank, ctx.world_size, accumulation))
        deltas.append(counted_since(before, ctx.comm.stats.snapshot()))
        norms.append(result.grad_norm)
    return norms, deltas
