"""Contestant `limit` of the data-parallel benches (ddp, zero1, zero2, zero3): the step with no communication.

Scenario ddp: the limit is ours exactly (same wrapper, buckets, levers and optimizer: `FlatAdamW`
when ours uses it) with every bucket collective replaced by nothing (`NoCommBucket`: launch and
complete do nothing, so the gradient stays this rank's own); only the one-time broadcasts at
construction and of the recorded bucket order remain, outside the timed steps. The other benches:

Every rank trains the plain, unwrapped Llama (the scenario's preset, seed and initial weights)
with a full, local `torch.optim.AdamW` (the scenario's LR; on torch's fused kernel when ours'
AdamW is, `--flat-adamw`) on its own token batches (the same
stream the other contestants get), with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`. Nothing is communicated: 0 bytes per step (counted, so the table
shows it). A synchronous data-parallel step cannot beat the same compute without its
communication, so ours/limit is how far a strategy is from the best it could do.

What is identical to the other contestants: model, parameter layout, data, forward and backward
arithmetic, optimizer class and LR, the loop. What is not, per scenario:
- zero1 / zero2: the limit steps AdamW over all Ψ parameters where ZeRO steps 1/N of them, and it
  holds the full 8Ψ optimizer state; the ZeRO step is cheaper, so the limit is not a floor for its
  optimizer phase (ours can in principle come within less than its communication of it, or beat it
  on the optimizer).
- zero3: as zero1/2 for the optimizer, and the limit keeps all parameters resident (no gather
  into, or freeing of, unit buffers), so its memory is not comparable.
The ranks' models diverge (each sees only its own data): their losses are not the synchronized ones.
"""

from __future__ import annotations

import torch

from ndtrain.bench.harness import LIMIT, BenchOptions, Contestant, Step, Workload, adamw_factory, training_step
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.buckets import AllReduceBucket


class NoCommBucket(AllReduceBucket):
    """A DDP bucket whose all-reduce is nothing: the gradient stays this rank's own (scenario ddp's limit)."""

    def launch(self) -> None:
        pass

    def complete(self) -> None:
        pass


def local_model(
    work: Workload, options: BenchOptions, ctx: ParallelContext, lr: float,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The plain model on this rank's device and a local AdamW over all its parameters (fused with
    `--flat-adamw`, as ours' then is)."""
    model = build_model(work.model, options.seed, ctx.device)
    return model, adamw_factory(lr, options.flat_adamw)(model.parameters())


def limit_contestant(work: Workload, options: BenchOptions, ctx: ParallelContext, lr: float) -> Contestant:
    def build() -> Step:
        return training_step(*local_model(work, options, ctx, lr), work.tokens)

    return Contestant(LIMIT, build, counted=True)  # counted: its 0 bytes are shown, not "-"
