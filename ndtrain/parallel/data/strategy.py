"""The one interface every data-parallel strategy is driven through, and the registry of strategies.

`Engine` composes model parallelism (parallel/compose.py), then hands the resulting module to exactly one
data-parallel strategy, built by `strategies[(parallel.dp_mode, parallel.zero)]`, and from then on
only uses the `DataParallelStrategy` below, for a strategy's whole life: the training step, what a
rank's checkpoint slices are and how its optimizer state is laid out (checkpoint/slices.py asks
`held_slices()`, `compute_copies()` and `optimizer_state()`, never the strategy's type or fields),
and the gradient synchronisation the pipeline runner is handed (`stage_hooks`, one
`pipeline.hooks.StageHooks` per chunk). No caller asks which strategy it holds.

Registration is a table, passed explicitly: a `Builder` per (dp_mode, zero) key. `STRATEGIES` is
the built-in table, the `Engine`'s default; ndtrain never changes it at run time. A new built-in
variant is its own file (the wrapper, an adapter class and a builder at its end) plus one line in
`STRATEGIES`; a variant of the user's own is its file plus one line that makes a table of its own,
`{**STRATEGIES, key: build_mine}`, given to `Engine(..., strategies=...)` (tests/test_strategy_plugin.py
trains, checkpoints and pipelines one that way).

| key                      | builder (file)                                  | adapter        |
|--------------------------|-------------------------------------------------|----------------|
| ("ddp", 0)               | `build_replicated` (replicated.py)              | `DDPStrategy` (fp32, ddp.py), `ZeroStrategy` (bf16/fp16: unsharded fp32 masters) |
| ("ddp", 1)               | `build_zero1` (zero_strategy.py)                | `ZeroStrategy` over Zero1DataParallel |
| ("ddp", 2)               | `build_zero2` (zero2_gradients.py)              | `ZeroStrategy` over Zero2DataParallel |
| ("ddp", 3)               | `build_zero3` (zero3_strategy.py)               | `FSDPStrategy` |
| ("single-process", 0/1)  | `build_replicated` / `build_zero1` (single_process.py) | as ("ddp", 0/1), over SingleProcessDataParallel |

`parallel.flat_adamw` wraps the optimizer factory (`fused_adamw_factory`) before any builder sees
it: a plain AdamW runs torch's fused kernel, over DDP's flat buckets (`FlatAdamW`, build_ddp) or
over the flat segments ZeRO's optimizers step.

Building communicates what the strategy's constructor does (broadcast or sharding of the initial
weights, see each file); the per-step costs are the strategies' own, given in their docstrings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data import single_process, zero2_gradients, zero3_strategy, zero_strategy
from ndtrain.parallel.data.flat_adamw import fused_adamw_factory
from ndtrain.parallel.data.held_slices import HeldSlice
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn
from ndtrain.parallel.data.replicated import build_replicated
from ndtrain.parallel.grad_norm import GradPiece
from ndtrain.parallel.pipeline.hooks import StageHooks


class ShardedModel(Protocol):
    """A model each rank holds only part of: it gathers the whole one (collective)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


class DataParallelStrategy(Protocol):
    """One data-parallel strategy around this rank's part of the model.

    Attributes:
    - `module`: what a forward runs (the wrapper; for an interleaved pipeline a ModuleList of them).
    - `chunks`: the wrapped modules the pipeline runs, one per stage chunk (one without pipeline).
    - `stage_hooks`: the pipeline runner's synchronisation hooks, one per chunk (pipeline/hooks.py).
    - `optimizer`: the optimizer the engine steps (and LR schedules see).
    - `grads_sharded`: `grad_pieces()` are this rank's shard of a gradient sharded over dp_cp, so the
      norm sums them over dp_cp (one 4-byte all-reduce); False: replicated, nothing to sum.
    - `sharded_model`: what gathers the whole model when each rank holds only shards (ZeRO-3), or None.
    - `forward_communicates`: a forward issues collectives (ZeRO-3's all-gathers), so every rank
      must run as many forwards (evaluation pads the ranks with fewer batches).
    """

    module: nn.Module
    chunks: list[nn.Module]
    stage_hooks: list[StageHooks]
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
        placement (parallel/grad_norm.py), for the global norm. No communication."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: "parameters", "gradients", "optimizer" (state and fp32 masters)."""
        ...

    def held_slices(self) -> list[HeldSlice]:
        """Every piece of every module parameter this rank's optimizer updates, each in the tensor the
        optimizer keys its state by (held_slices.py), in a deterministic order; a parameter the
        optimizer does not own (frozen) whole, held in itself. What a checkpoint writes and refills."""
        ...

    def compute_copies(self) -> list[nn.Parameter]:
        """Module parameters a load must also fill whole, besides the slices' owners: replicated
        compute copies the optimizer does not update in place (ZeRO-1/2's flat buffers); else []."""
        ...

    def optimizer_state(self) -> MutableMapping[torch.Tensor, dict[str, Any]]:
        """The optimizer's per-owner state, keyed by the slices' owners (AdamW: exp_avg, exp_avg_sq,
        step); a load fills it in place."""
        ...


Builder = Callable[[nn.Module, ParallelContext, ParallelConfig, OptimizerFn, GroupFn], DataParallelStrategy]
Strategies = Mapping[tuple[str, int], Builder]

STRATEGIES: dict[tuple[str, int], Builder] = {
    ("ddp", 0): build_replicated,
    ("ddp", 1): zero_strategy.build_zero1,
    ("ddp", 2): zero2_gradients.build_zero2,
    ("ddp", 3): zero3_strategy.build_zero3,
    ("single-process", 0): single_process.build_replicated,
    ("single-process", 1): single_process.build_zero1,
}


def build_data_parallel(
    model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn,
    strategies: Strategies = STRATEGIES,
) -> DataParallelStrategy:
    """The strategy of `strategies` that `cfg` asks for (dp_mode, zero) around `model`, with its
    optimizer built by `optimizer_fn(groups)` from the parameter groups `group_fn` defines."""
    key = (cfg.dp_mode, cfg.zero)
    builder = strategies.get(key)
    if builder is None:
        raise UserError(
            f"no data-parallel strategy for parallel.dp_mode={key[0]!r} with parallel.zero={key[1]}: "
            f"choose one of {sorted(strategies)}"
        )
    if cfg.flat_adamw:  # AdamW on torch's fused kernel: DDP's FlatAdamW, or over ZeRO's flat segments (flat_adamw.py)
        optimizer_fn = fused_adamw_factory(optimizer_fn)
    return builder(model, ctx, cfg, optimizer_fn, group_fn)
