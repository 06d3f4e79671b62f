"""The one interface the engine drives every data-parallel strategy through, and their registry.

`Engine` composes model parallelism (compose.py), then hands the resulting module to exactly one
data-parallel strategy, chosen by `STRATEGIES[(parallel.dp_mode, parallel.zero)]`, and from then on
only calls the methods below: it never asks which strategy it holds. A strategy wraps the module
(taking over its gradient synchronisation) and builds the optimizer over whatever it shards.
Adding a strategy is its own file (the wrapper, and an adapter class plus a builder appended at
its end) and one line in `STRATEGIES`.

| key                      | builder (file)                                  | adapter        |
|--------------------------|-------------------------------------------------|----------------|
| ("ddp", 0)               | `build_replicated` (zero1_optimizer.py)         | `DDPStrategy` (fp32), `ZeroStrategy` (bf16/fp16: unsharded fp32 masters) |
| ("ddp", 1)               | `build_zero1` (zero1_optimizer.py)              | `ZeroStrategy` over DDP |
| ("ddp", 2)               | `build_zero2` (zero2_gradients.py)              | `ZeroStrategy` over Zero2DataParallel |
| ("ddp", 3)               | `build_zero3` (zero3_parameters.py)             | `FSDPStrategy` |
| ("single-process", 0/1)  | `build_replicated` / `build_zero1` (parallel/data/single_process.py) | as ("ddp", 0/1), over SingleProcessDataParallel |

`parallel.flat_adamw` wraps the optimizer factory (`fused_adamw_factory`) before any builder sees
it: a plain AdamW runs torch's fused kernel, over DDP's flat buckets (`FlatAdamW`, build_ddp) or
over the flat segments ZeRO's optimizers step.

Building communicates what the strategy's constructor does (broadcast or sharding of the initial
weights, see each file); the per-step costs are the strategies' own, given in their docstrings.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data import single_process as single_process_dp
from ndtrain.parallel.data import zero1_optimizer
from ndtrain.parallel.data import zero2_gradients
from ndtrain.parallel.data import zero3_parameters
from ndtrain.parallel.data.flat_adamw import fused_adamw_factory
from ndtrain.parallel.grad_norm import GradPiece
from ndtrain.parallel.data.zero1_optimizer import GroupFn, OptimizerFn


class ShardedModel(Protocol):
    """A model each rank holds only part of: it gathers the whole one (collective)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


class DataParallelStrategy(Protocol):
    """One data-parallel strategy around this rank's part of the model.

    Attributes:
    - `module`: what a forward runs (the wrapper; for an interleaved pipeline a ModuleList of them).
    - `chunks`: the wrapped modules the pipeline runs, one per stage chunk (one without pipeline).
    - `optimizer`: the optimizer the engine steps (and LR schedules and checkpoints see).
    - `grads_sharded`: `grad_pieces()` are this rank's shard of a gradient sharded over dp_cp, so the
      norm sums them over dp_cp (one 4-byte all-reduce); False: replicated, nothing to sum.
    - `sharded_model`: what gathers the whole model when each rank holds only shards (ZeRO-3), or None.
    - `forward_communicates`: a forward issues collectives (ZeRO-3's all-gathers), so every rank
      must run as many forwards (evaluation pads the ranks with fewer batches).
    """

    module: nn.Module
    chunks: list[nn.Module]
    optimizer: torch.optim.Optimizer
    grads_sharded: bool
    sharded_model: ShardedModel | None
    forward_communicates: bool

    def no_sync(self) -> AbstractContextManager[None]:
        """The context of a backward that is not the step's last: a strategy that accumulates locally
        defers its gradient sync (free); one that keeps gradients sharded reduces anyway (a no-op)."""
        ...

    def zero_grad(self) -> None:
        """Zero the gradients the next backward accumulates into (in place; no communication)."""
        ...

    def step_during_backward(self, allowed: bool) -> None:
        """The engine says once whether the optimizer update may run while backward and the gradient
        sync are still going on (True only when nothing after backward can veto or change it: no
        clipping, no loss scaler, no skipping of non-finite steps). A strategy that can overlap its
        update (DDP with `parallel.overlap_optimizer`) does so when allowed; the others ignore it.
        `optimizer.step()` must still be called: it updates whatever was not updated yet."""
        ...

    def optimizer_grads(self) -> list[torch.Tensor]:
        """The fp32 (or float64) gradient tensors the optimizer's step reads, after backward: unscaling
        or clipping them in place is what the step applies. No communication."""
        ...

    def grad_pieces(self) -> list[GradPiece]:
        """This rank's pieces of the gradient the optimizer reads, each weighted by its parameter's
        placement (grad_norm.py), for the global norm. No communication."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: "parameters", "gradients", "optimizer" (state and fp32 masters)."""
        ...


Builder = Callable[[nn.Module, ParallelContext, ParallelConfig, OptimizerFn, GroupFn], DataParallelStrategy]

STRATEGIES: dict[tuple[str, int], Builder] = {
    ("ddp", 0): zero1_optimizer.build_replicated,
    ("ddp", 1): zero1_optimizer.build_zero1,
    ("ddp", 2): zero2_gradients.build_zero2,
    ("ddp", 3): zero3_parameters.build_zero3,
    ("single-process", 0): single_process_dp.build_replicated,
    ("single-process", 1): single_process_dp.build_zero1,
}


def build_data_parallel(
    model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn,
) -> DataParallelStrategy:
    """The strategy `cfg` asks for (dp_mode, zero) around `model`, with its optimizer built by
    `optimizer_fn(groups)` from the parameter groups `group_fn` defines."""
    key = (cfg.dp_mode, cfg.zero)
    builder = STRATEGIES.get(key)
    if builder is None:
        raise UserError(
            f"no data-parallel strategy for parallel.dp_mode={key[0]!r} with parallel.zero={key[1]}: "
            f"choose one of {sorted(STRATEGIES)}"
        )
    if cfg.flat_adamw:  # AdamW on torch's fused kernel: DDP's FlatAdamW, or over ZeRO's flat segments (flat_adamw.py)
        optimizer_fn = fused_adamw_factory(optimizer_fn)
    return builder(model, ctx, cfg, optimizer_fn, group_fn)
