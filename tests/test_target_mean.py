"""The step's loss is the mean over every target of the global batch (parallel/target_mean.py), under
gradient accumulation and every layout: dp2, dp2 with ZeRO-3, tp2 with sequence parallelism, pp2, cp2 and
dp2×tp2 train a float64 Llama on masked, packed, accumulated micro-batches exactly as one process that
sums `F.cross_entropy(..., ignore_index=-100)` over every document run alone and divides by the global
batch's target count (an independent reference, not our loss or mask code).

The rows are packed documents (positions restarting at each document; boundaries inside cp2's chunks
and on their edges) and their targets are masked so that micro-batches hold very different numbers of
targets: full rows, a row with one target, rows with none, and rows whose targets lie only in the middle
of the sequence (under cp2's balanced split one rank's shard of such a row holds no target); the target
crossing a document boundary is never one. The reference runs every document alone (its own forward),
so it owes nothing to ndtrain's document masks. The mean of per-micro-batch means, which gradient
accumulation used to take, trains measurably different weights: the test would see it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from ndtrain.parallel.target_mean import IGNORE_INDEX
from tests.helpers.layouts import DTYPE, GLOBAL_BATCH, MAX_NORM, MODEL, SEQ, STEPS, adamw, batch
from tests.helpers.parity import assert_params_close, max_relative_error
from tests.helpers.reference import decay_groups
from tests.helpers.runner import case_result, init_method, run_distributed, run_each

TOLERANCE = 1e-10  # float64: summation-order noise is ~1e-13
WORLD2: dict[str, dict[str, Any]] = {
    "dp2": dict(dp=2), "dp2-zero3": dict(dp=2, zero=3), "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2), "cp2": dict(cp=2),
}
WORLD4: dict[str, dict[str, Any]] = {"dp2-tp2": dict(dp=2, tp=2)}

pytestmark = pytest.mark.usefixtures("one_thread")


DOCUMENTS = [[16], [5, 11], [8, 8], [3, 6, 7], [16], [10, 6], [4, 4, 4, 4], [7, 9]]  # lengths per row (SEQ = 16)


def masked_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layouts' global batch as packed documents (`DOCUMENTS`) with targets kept as follows, per row:
    all, one, none, positions 4–11 only (cp2's middle chunks), all, the first three, none, the last
    twelve; never the last token's of a document followed by another (its target is the next one's start)."""
    x, y = batch(step)
    keep = torch.zeros_like(y, dtype=torch.bool)
    keep[0] = keep[4] = True
    keep[1, (step * 5) % SEQ] = True
    keep[3, 4:12] = True
    keep[5, :3] = True
    keep[7, 4:] = True
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in DOCUMENTS])
    crossing = torch.roll(positions, -1, dims=1) == 0
    crossing[:, -1] = False
    return x, torch.where(keep & ~crossing, y, IGNORE_INDEX), positions


def rows(step: int, rank: int, ranks: int) -> list[tuple[torch.Tensor, ...]]:
    """This dp rank's share of the global batch as one-row micro-batches (accumulation = rows per rank)."""
    x, y, positions = masked_batch(step)
    per = GLOBAL_BATCH // ranks
    return [(x[i : i + 1], y[i : i + 1], positions[i : i + 1]) for i in range(rank * per, (rank + 1) * per)]


def document_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """(Σ cross-entropy over its targets, target count) of every document, each run through the model alone."""
    out = []
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in lengths:
            logits = model(x[row : row + 1, start : start + n])[0]
            targets = y[row, start : start + n]
            out.append((F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"),
                        int((targets != IGNORE_INDEX).sum())))
            start += n
    return out


def reference(mean_of_means: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, every document alone, the loss summed over the global batch's targets and divided by
    their count; or (`mean_of_means`) the mean of the per-row means that accumulation over one-row
    micro-batches used to take (rows without targets counting 0)."""
    model = build_model(MODEL, seed=0).to(DTYPE)
    optimizer = adamw(decay_groups(model))
    losses = []
    for step in range(STEPS):
        x, y, _ = masked_batch(step)
        pieces = document_losses(model, x, y)
        if mean_of_means:
            per_row, i = [], 0
            for lengths in DOCUMENTS:
                row = pieces[i : i + len(lengths)]
                i += len(lengths)
                per_row.append(sum(l for l, _ in row) / max(1, sum(n for _, n in row)))
            loss = sum(per_row) / len(per_row)
        else:
            loss = sum(l for l, _ in pieces) / sum(n for _, n in pieces)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _train(layout: dict[str, Any]) -> dict[str, Any]:
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    engine = Engine(lambda: build_model(MODEL, seed=0).to(DTYPE), adamw, ctx, parallel, group_fn=no_decay_for_vectors,
                    grad_clip=MAX_NORM)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    results = [engine.train_step(rows(step, rank, dp)) for step in range(STEPS)]
    evaluation = engine.evaluate(rows(STEPS, rank, dp))
    return {"losses": [r.loss for r in results], "tokens": [r.tokens for r in results],
            "val": (evaluation.loss, evaluation.tokens), "state": engine.full_state_dict()}


def _workers(layouts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return run_each(lambda name: _train(layouts[name]), layouts)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any]]:
    two, four = run_distributed(_workers, 2, WORLD2, timeout=300), run_distributed(_workers, 4, WORLD4, timeout=300)
    return {name: case_result(two if name in WORLD2 else four, name) for name in [*WORLD2, *WORLD4]}


@pytest.fixture(scope="module")
def want() -> tuple[dict[str, torch.Tensor], list[float]]:
    return reference()


def test_single_process_accumulation_is_the_global_target_mean(want: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    state, losses = want
    engine = Engine(lambda: build_model(MODEL, seed=0).to(DTYPE), adamw, init(ParallelConfig()), ParallelConfig(),
                    group_fn=no_decay_for_vectors, grad_clip=MAX_NORM)
    got = [engine.train_step(rows(step, 0, 1)) for step in range(STEPS)]
    assert [r.loss for r in got] == pytest.approx(losses, rel=TOLERANCE)
    assert all(r.tokens == GLOBAL_BATCH * SEQ for r in got)
    assert_params_close(engine.full_state_dict(), state, TOLERANCE, "one process, 8 micro-batches")
    old, _ = reference(mean_of_means=True)
    assert max_relative_error(old, state) > 1e-4  # the mean of means trains other weights: the test can fail


@pytest.mark.parametrize("name", [*WORLD2, *WORLD4])
def test_layout_trains_on_the_global_target_mean(name: str, runs: dict[str, list[Any]],
                                                want: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    state, losses = want
    x, y, _ = masked_batch(STEPS)
    with torch.no_grad():
        model = build_model(MODEL, seed=0).to(DTYPE)
        model.load_state_dict(state)
        pieces = document_losses(model, x, y)
        val = (sum(l for l, _ in pieces) / sum(n for _, n in pieces)).item()
    merged: dict[str, torch.Tensor] = {}
    for run in runs[name]:
        assert run["losses"] == pytest.approx(losses, rel=TOLERANCE)
        assert run["val"][0] == pytest.approx(val, rel=TOLERANCE)
        assert run["val"][1] == int((y != IGNORE_INDEX).sum())
        merged.update(run["state"])
    assert_params_close(merged, state, TOLERANCE, name)


def test_micro_batch_without_targets_adds_nothing() -> None:
    """A step whose global batch has no target: loss 0, zero gradients (AdamW's decay alone moves weights)."""
    engine = Engine(lambda: build_model(MODEL, seed=0).to(DTYPE), lambda g: torch.optim.SGD(g, lr=0.1), init(ParallelConfig()),
                    ParallelConfig())
    before = engine.full_state_dict()
    x, y = batch(0)
    result = engine.train_step([(x[:2], torch.full_like(y[:2], IGNORE_INDEX))])
    assert result.loss == 0.0 and result.grad_norm == 0.0
    assert_params_close(engine.full_state_dict(), before, 0.0, "no targets")
