"""Tensor parallel inside a mixture-of-experts layer: every expert's matrices split over tp, the router whole.

What is split, over the n ranks of the tp group (styles `packed_colwise`, `rowwise` on an expert
parameter, `moe_tp_experts` on the module holding them, as transformers declares for Mixtral,
Qwen2-MoE, Qwen3-MoE): an experts module holds E experts as 3-D parameters,
`gate_up_proj` [E, 2I, d] (gate and up packed along dim 1) and `down_proj` [E, d, I]. Rank r keeps
its I/n features of the gate half and of the up half (`packed_colwise`, `Shard.blocks` = 2: never a
split across the boundary) and the same I/n input features of `down_proj` (`rowwise`, the last
dim), so every rank runs every expert on its I/n intermediate features and the experts module's
output is a partial sum. The module's `intermediate_dim` is set to I/n. The router (which picks
each token's top-k experts and their weights) stays replicated, identical on every rank.

What is communicated (N tokens of width d reach the experts module, k experts per token):
- without sequence parallelism every rank holds all N tokens: the input hidden states and the
  routing weights enter through f (identity forward; backward all-reduce of N·d and N·k: each rank's
  gradient covers its features only), and the output is summed by g (all-reduce of N·d forward). The
  router's gradient is then whole and identical on every rank.
- with sequence parallelism the layer sees this rank's N/n tokens: the hidden states, the expert
  indices and the routing weights are all-gathered over tp (N·(d + 2k) elements, (n−1)/n of it on
  the wire per rank; the gradients reduce-scattered back), and the output partial sums are
  reduce-scattered onto the same token shard (the gradient all-gathered). The router saw only this
  rank's tokens: its gradient is summed over tp like every replicated parameter's under sequence
  parallelism (tp_plan.py).
Memory: each expert's weights and their gradients take 1/n; activations inside the experts module
are N·I/n per rank (N whole: the tokens are gathered under sequence parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.errors import UserError
from ndtrain.parallel.model.tensor import CopyToParallel, ReduceFromParallel, _slice
from ndtrain.parallel.placement import carry_placement

EXPERT_STYLES = ("packed_colwise", "rowwise")  # styles a plan may give an expert parameter
_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")  # how transformers' experts modules are called


def _gather_rows(x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
    shard = x.contiguous()
    full = shard.new_empty((group.size * shard.shape[0], *shard.shape[1:]))
    comm.all_gather(full, shard, group)
    return full


def _scatter_rows(x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
    full = x.contiguous()
    shard = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    comm.reduce_scatter(shard, full, group)
    return shard


class GatherTokens(torch.autograd.Function):
    """All-gather the token shards (dim 0) forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _gather_rows(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scatter_rows(grad, ctx.comm, ctx.group), None, None


class ScatterTokens(torch.autograd.Function):
    """Reduce-scatter partial sums onto this rank's token shard (dim 0) forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _scatter_rows(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_rows(grad, ctx.comm, ctx.group), None, None


def split_expert_parameter(module: nn.Module, name: str, style: str, group: Group) -> nn.Parameter:
    """Replace `module`'s parameter `name` by this rank's part of it: `packed_colwise` splits the
    packed dim (−2) per block of two, `rowwise` the input features (the last dim)."""
    full = getattr(module, name)
    dim, blocks = (full.ndim - 2, 2) if style == "packed_colwise" else (full.ndim - 1, 1)
    weight, shard = _slice(full, dim, group.rank, group.size, full.shape[dim], blocks)
    new = carry_placement(nn.Parameter(weight, requires_grad=full.requires_grad), full, tp=shard)
    setattr(module, name, new)
    return new


def check_expert_parameter(name: str, param: torch.Tensor, style: str, tp: int) -> None:
    """UserError unless tp splits `param` (`name` in messages) the way `style` says."""
    if param.ndim < 2:
        raise UserError(f"--tp {tp}: tp plan gives parameter {name!r} of shape {list(param.shape)} the style {style}, "
                        "which splits 2-D or 3-D expert weights only")
    dim, parts = (param.ndim - 2, 2 * tp) if style == "packed_colwise" else (param.ndim - 1, tp)
    if param.shape[dim] % parts:
        what = "packs gate and up of" if style == "packed_colwise" else "has"
        size = param.shape[dim] // 2 if style == "packed_colwise" else param.shape[dim]
        raise UserError(f"--tp {tp}: {name!r} {what} {size} intermediate features per expert, not divisible by "
                        f"tp={tp}: choose a tp dividing the experts' intermediate size")


class ExpertsInput:
    """Forward pre-hook (`with_kwargs=True`) of an experts module called as (hidden_states [N, d],
    top_k_index [N, k], top_k_weights [N, k]): f on the hidden states and weights, or with sequence
    parallelism the three gathered over tp."""

    def __init__(self, comm: Communicator, group: Group, sequence_parallel: bool) -> None:
        self.comm, self.group, self.sequence_parallel = comm, group, sequence_parallel

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rest = dict(kwargs)
        values = list(args) + [rest.pop(name) for name in _INPUTS[len(args):] if name in rest]
        if len(values) < len(_INPUTS):
            raise UserError(f"tensor parallel: {type(module).__name__} was not called with "
                            f"({', '.join(_INPUTS)}): moe_tp_experts cannot split it")
        hidden, index, weights = values[:3]
        # HF's routers may hand fp32 weights to float64 experts: the product is computed in the promoted dtype
        # anyway, and casting first lets each rank's partial weight gradient reach the sum before fp32 rounding
        weights = weights.to(torch.promote_types(hidden.dtype, weights.dtype))
        if self.sequence_parallel:
            hidden = GatherTokens.apply(hidden, self.comm, self.group)
            weights = GatherTokens.apply(weights, self.comm, self.group)
            index = _gather_rows(index, self.comm, self.group)
        else:
            hidden = CopyToParallel.apply(hidden, self.comm, self.group)
            weights = CopyToParallel.apply(weights, self.comm, self.group)
        return (hidden, index, weights, *values[3:]), rest


class ExpertsOutput:
    """Forward hook of an experts module: its partial sums all-reduced (g), or reduce-scattered onto
    this rank's tokens with sequence parallelism."""

    def __init__(self, comm: Communicator, group: Group, sequence_parallel: bool) -> None:
        self.comm, self.group = comm, group
        self.op = ScatterTokens if sequence_parallel else ReduceFromParallel

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.op.apply(output, self.comm, self.group)


def parallelize_experts(module: nn.Module, comm: Communicator, group: Group, sequence_parallel: bool) -> None:
    """Install the experts module's communication (its parameters are split by their own styles) and
    make its `intermediate_dim` the local one."""
    module.register_forward_pre_hook(ExpertsInput(comm, group, sequence_parallel), with_kwargs=True)
    module.register_forward_hook(ExpertsOutput(comm, group, sequence_parallel))
    if isinstance(getattr(module, "intermediate_dim", None), int):
        module.intermediate_dim //= group.size
