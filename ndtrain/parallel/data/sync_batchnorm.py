"""Synchronised BatchNorm (`parallel.sync_batchnorm`): every BatchNorm layer normalises over the whole
batch of the data-parallel group, as one process holding the global batch would.

What is split: the batch. Rank r of the N ranks of `dp_cp` holds x_r [n_r, C, *] (n_r may differ
between ranks, and be 0). Per channel, over all ranks' elements, mean μ and biased variance σ²
normalise, x̂ = (x − μ)/√(σ² + ε), y = γ·x̂ + β; the running statistics are updated from the same
global μ and the unbiased variance σ²·n/(n − 1) (n = Σ n_r elements per channel), with torch's
rules (momentum, or the cumulative average when momentum is None; `num_batches_tracked`), so
they stay identical on every rank.

What is communicated, per BatchNorm layer and training forward (micro-batch), in the statistics
dtype (float32 for 16-bit inputs, else the input's) of e bytes:
- forward: one all-gather of each rank's (n_r, μ_r, M2_r) per channel (M2_r = Σ (x − μ_r)², from a
  local two-pass `var_mean`), 2C + 1 elements per rank: (N−1)(2C+1)·e bytes sent per rank. The ranks
  combine them with Chan's parallel formula, μ = Σ n_r μ_r / n, M2 = Σ M2_r + n_r (μ_r − μ)²,
  which never subtracts two large sums (an all-reduce of Σx and Σx² would lose the variance to
  cancellation in float32 when |μ| ≫ σ; torch's own SyncBatchNorm gathers for the same reason).
- backward: one all-reduce of Σ dy and Σ dy·(x − μ) per channel, 2C elements: 2(N−1)/N·2C·e bytes.
  The input's gradient uses the group's sums (the exact gradient of the sum of every rank's loss
  through the shared statistics); γ's and β's gradients are this rank's own sums, averaged over the
  ranks by the data-parallel strategy like any parameter's. Skipped when the input needs no gradient.
- evaluation (`module.eval()`): the running statistics, nothing communicated (a layer that tracks none
  normalises each rank's own batch, as torch's SyncBatchNorm does).
No host synchronisation: counts stay on the device. Each collective is counted under "dp_cp".

`synchronise_batchnorm(model, ctx)` replaces every BatchNorm layer (nn.BatchNorm1d/2d/3d, torch's
nn.SyncBatchNorm) by a `SyncBatchNorm` that holds the same parameter and buffer tensors, so names,
checkpoints and initial values are unchanged; the engine calls it before model parallelism and the
data-parallel strategy see the model. Every rank must run the same BatchNorm layers in the same
order (one collective each), as with every collective of a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.mesh import ParallelContext

INPUT_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,),
}


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums are formed: float32 for 16-bit inputs, else the input's own dtype (float64 stays)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector [C] shaped to broadcast over x [n, C, *]."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def global_moments(x: torch.Tensor, comm: Communicator, group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per channel over every rank's `x`: (mean [C], biased variance [C], element count [] ), in the
    statistics dtype. One all-gather of 2C + 1 elements per rank (collective)."""
    channels = x.shape[1]
    xs = x.detach().to(statistics_dtype(x.dtype))
    count = x.numel() // channels if channels else 0
    if count:
        var, mean = torch.var_mean(xs, dim=_reduced_dims(x), correction=0)
        m2 = var * count
    else:  # an empty shard adds nothing to the sums
        mean = m2 = xs.new_zeros(channels)
    row = torch.cat([xs.new_full((1,), float(count)), mean, m2])
    rows = row.new_empty(group.size * row.numel())
    comm.all_gather(rows, row, group)
    rows = rows.view(group.size, -1)
    counts, means, m2s = rows[:, :1], rows[:, 1 : channels + 1], rows[:, channels + 1 :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = γ·(x − μ)·invstd + β with μ, invstd the group's statistics; backward all-reduces 2C sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, total: torch.Tensor, comm: Communicator,
                group: Group) -> torch.Tensor:
        xs = x.to(mean.dtype)
        y = (xs - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.to(mean.dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(mean.dtype), x)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.comm, ctx.group, ctx.bias_dtype = comm, group, None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd, total = ctx.saved_tensors
        dims = _reduced_dims(x)
        dys = dy.to(mean.dtype)
        xmu = x.to(mean.dtype) - _per_channel(mean, x)
        sum_dy, sum_dy_xmu = dys.sum(dims), (dys * xmu).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xmu])  # a copy: γ's and β's gradients keep the local sums
            ctx.comm.all_reduce(sums, ctx.group)
            group_dy, group_dy_xmu = sums.chunk(2)
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_x = (dys - _per_channel(group_dy / total, x)
                      - xmu * _per_channel(group_dy_xmu * invstd * invstd / total, x)) * _per_channel(scale, x)
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training forward normalises over `group`'s whole batch (module docstring).

    Built by `replacing(bn, comm, group)`: the same parameter and buffer tensors as `bn`, its
    options (eps, momentum, affine, track_running_stats) and the input ranks its class accepts."""

    comm: Communicator
    group: Group
    input_dims: tuple[int, ...]  # the input ranks accepted (empty: any rank >= 2)

    @classmethod
    def replacing(cls, bn: _BatchNorm, comm: Communicator, group: Group) -> SyncBatchNorm:
        sync = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta")
        for name in ("weight", "bias"):
            sync._parameters[name] = bn._parameters.get(name)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            sync._buffers[name] = bn._buffers.get(name)
        sync.training = bn.training
        sync.comm, sync.group = comm, group
        sync.input_dims = next((dims for kind, dims in INPUT_DIMS.items() if isinstance(bn, kind)), ())
        return sync

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2 or (self.input_dims and input.dim() not in self.input_dims):
            wanted = " or ".join(f"{d}D" for d in self.input_dims) or "at least 2D"
            raise ValueError(f"expected {wanted} input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)  # running statistics (or this rank's batch without them): no communication
        self._check_input_dim(input)
        if self.group.size == 1 and input.numel() <= input.shape[1]:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(input.shape)}")
        mean, var, total = global_moments(input, self.comm, self.group)
        if self.track_running_stats:
            self._update_running(mean, var, total)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, total, self.comm, self.group)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        """torch's update from the group's statistics: the same on every rank. A group total of one
        element (every other rank empty) has no unbiased variance; its biased one (0) is used."""
        factor: float | torch.Tensor | None = self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # on the device, where torch reads the counter to the host
                factor = self.num_batches_tracked.double().reciprocal()
        assert factor is not None  # momentum None always tracks batches
        unbiased = var * total / (total - 1).clamp(min=1)
        for running, value in ((self.running_mean, mean), (self.running_var, unbiased)):
            assert running is not None
            running.mul_(1 - factor).add_(value.to(running.dtype) * factor)


def convert_sync_batchnorm(module: nn.Module, comm: Communicator, group: Group) -> nn.Module:
    """`module` with every BatchNorm layer (any `_BatchNorm` but ours) replaced in place by a
    `SyncBatchNorm` over `group` holding the same tensors; returns the root (itself, unless it is
    a BatchNorm layer). A layer registered at several places is replaced by one `SyncBatchNorm`."""
    replaced: dict[int, nn.Module] = {}

    def convert(node: nn.Module) -> nn.Module:
        if isinstance(node, _BatchNorm) and not isinstance(node, SyncBatchNorm):
            return replaced.setdefault(id(node), SyncBatchNorm.replacing(node, comm, group))
        for name, child in node.named_children():
            node._modules[name] = convert(child)
        return node

    return convert(module)


def synchronise_batchnorm(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """`convert_sync_batchnorm` over the group gradients are averaged over (dp × cp)."""
    return convert_sync_batchnorm(model, ctx.comm, ctx.group("dp_cp"))


def synchronised_buffers(model: nn.Module) -> set[int]:
    """The ids of the buffers of `model`'s `SyncBatchNorm` layers: identical on every rank by construction."""
    return {id(b) for m in model.modules() if isinstance(m, SyncBatchNorm) for b in m.buffers()}


def describe_batchnorm(model: nn.Module, ranks: int, micro_batch: int) -> str | None:
    """The run description's line on `model`'s BatchNorm layers (None without any): over how many samples
    they normalise, on `ranks` data-parallel ranks of `micro_batch` samples each."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    synced = sum(isinstance(m, SyncBatchNorm) for m in layers)
    if not layers or (ranks == 1 and not synced):
        return None
    if synced == len(layers):
        return (f"{synced} BatchNorm layers normalise over {ranks} rank{'s' * (ranks > 1)} × micro-batch {micro_batch} = "
                f"{ranks * micro_batch} samples (parallel.sync_batchnorm)")
    return (f"{len(layers) - synced} BatchNorm layers normalise each rank's micro-batch of {micro_batch} samples and "
            f"their running statistics drift apart: set parallel.sync_batchnorm = true to normalise over "
            f"{ranks * micro_batch}")
