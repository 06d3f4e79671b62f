"""The loss of a step: the mean over every target token of the global batch, whatever the layout.

A target equal to `IGNORE_INDEX` (−100: a prompt token, padding, the boundary between two packed
documents) is not a target, so micro-batches hold different numbers of targets. A model's loss (its
own or the caller's `loss_fn`) is the mean over the targets of its input, 0 when it has none
(`mean_cross_entropy`: F.cross_entropy's mean would be 0/0). Averaging those means over micro-batches
and ranks, as gradient accumulation and data parallelism did before, over-weights the targets of a
sparse micro-batch (the gradient-accumulation defect several trainers shipped in 2024). Instead the
engine weights micro-batch i of rank r by

    w_ri = n_ri · G / N,    N = Σ_ri n_ri (the global batch's targets), G = dp × cp ranks,

where n_ri counts its targets (this rank's sequence shard under context parallelism; the same count on
every tp and pp rank, which hold the same micro-batch). The data-parallel strategies average gradients
over the G ranks of dp×cp, so the gradient applied is that of Σ_ri loss_ri · n_ri / N: the mean over
all targets of the global batch. With every target present (n_ri = B·T/cp) w_ri = 1/k, as before.

Cost: the counts are taken on the device (B·T comparisons per micro-batch); one all-reduce of one
number over dp×cp before a step's first forward (8 bytes); counts and weights stay on the device (no
host synchronisation). A step whose global batch has no target
gets weights 0: zero gradients, loss 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ndtrain.data.corpus import IGNORE as IGNORE_INDEX  # the data's mark of a target never counted (−100)
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.precision import at_least_fp32


def target_count(targets: torch.Tensor) -> torch.Tensor:
    """How many entries of `targets` are targets (≠ IGNORE_INDEX), as a 0-dim float64 tensor on their
    device (no host synchronisation)."""
    return targets.ne(IGNORE_INDEX).sum(dtype=torch.float64)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` [..., V] over the targets ≠ IGNORE_INDEX of `targets` [...], in fp32
    (float64 for a float64 model); 0, with zero gradients, when there is none."""
    flat = targets.flatten()
    total = F.cross_entropy(at_least_fp32(logits).flatten(0, -2), flat, reduction="sum")
    return total / flat.ne(IGNORE_INDEX).sum().clamp(min=1)


def step_weights(counts: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The weights w_i = n_i · G / N of this rank's micro-batches from their target counts `counts` (float64,
    on the device): one 8-byte all-reduce over dp×cp (see the module docstring)."""
    group = ctx.group("dp_cp")
    total = counts.sum().reshape(1)
    ctx.comm.all_reduce(total, group)
    return counts * group.size / total.clamp(min=1.0)
