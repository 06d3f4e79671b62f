"""ZeRO-0: every rank holds the whole model, gradients and optimizer state; gradients are all-reduced.

In fp32 the strategy is DDP with the caller's optimizer over the whole model (`build_ddp`,
ddp.py: `DDPStrategy`, with DDP's levers). In bf16/fp16 the model computes in that dtype and an
unsharded `ZeroOptimizer` (`sharded=False`, zero_strategy.py) keeps the whole fp32 master copy
beside it: nothing is gathered after the step. Communication per step is DDP's all-reduce,
2(N−1)/N·G bytes per rank (G: gradient bytes in the comm dtype); memory per rank, Ψ parameters,
4Ψ parameters + 4Ψ gradients + 8Ψ AdamW state in fp32; in bf16/fp16 the parameters and gradients
in that dtype plus 4Ψ of fp32 masters beside AdamW's 8Ψ (and the fp32 casts of the gradients the
step reads, made after backward).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.ddp import DDPStrategy, build_ddp, ddp_chunks
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn, parameter_groups
from ndtrain.parallel.data.zero_strategy import ZeroStrategy, cast_to_compute, zero_over_ddp
from ndtrain.parallel.precision import DTYPES


def build_replicated(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn, *,
                     wrap: Callable[[nn.Module], nn.Module] = lambda module: module) -> DDPStrategy | ZeroStrategy:
    """ZeRO-0: DDP (over `wrap(model)`) with the caller's optimizer over the whole model, or, in
    bf16/fp16, an unsharded `ZeroOptimizer` holding the fp32 masters."""
    masters = cast_to_compute(model, DTYPES[cfg.precision])
    if masters is None:
        return build_ddp(wrap(model), ctx, cfg, lambda: optimizer_fn(parameter_groups(model, group_fn)))
    return zero_over_ddp(ddp_chunks(wrap(model), ctx, cfg), ctx, optimizer_fn, group_fn, masters=masters, sharded=False)
