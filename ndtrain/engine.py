"""`Engine`: one model + optimizer trained under a `ParallelContext`.

The engine places the model on the context's device, wraps it in the data-parallel strategy
(our `DataParallel`: gradients all-reduced over dp×cp during backward; with `zero=1` the
optimizer state is sharded over the same ranks by `ZeroOptimizer`), and runs one optimizer
step per `train_step` over the micro-batches it is given: forward/backward of each (gradient
sync only on the last, via `no_sync`), global gradient norm and clipping, optimizer and LR
schedule step. Per step it communicates the gradient all-reduce (2(N−1)/N · 4Ψ bytes for Ψ fp32
parameters; with `zero=1` also the parameter all-gather, (N−1)/N · 4Ψ) plus one 8-byte
all-reduce of the loss and token count for reporting.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ndtrain.memory import optimizer_state_bytes, tensor_bytes
from ndtrain.mesh import ParallelContext
from ndtrain.parallel.ddp import DataParallel
from ndtrain.parallel.replicate import SingleProcessDataParallel
from ndtrain.parallel.zero import GroupFn, ZeroOptimizer, no_decay_for_vectors, parameter_groups

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), both [B, T] int64

_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class StepResult:
    loss: float          # mean loss over the global batch
    tokens: int          # tokens in the global batch
    grad_norm: float     # global gradient norm before clipping
    lr: float            # learning rate used for this step
    comm_bytes: int      # wire bytes this rank sent during the step


class Engine:
    """Builds and drives one model replica of the data-parallel group."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        optimizer_fn: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        ctx: ParallelContext,
        *,
        group_fn: GroupFn = no_decay_for_vectors,
        scheduler_fn: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
        grad_clip: float = 0.0,
    ) -> None:
        """`optimizer_fn(groups)` builds the optimizer from parameter groups (`group_fn(name, param)`
        gives each parameter's group options); with `zero=1` the groups hold this rank's shards."""
        ctx.config.check_implemented()
        self.ctx = ctx
        self.model = model_fn().to(ctx.device)
        module = self.model  # dp_mode=single-process: replicas on threads inside this process
        if ctx.config.dp_mode == "single-process":
            module = SingleProcessDataParallel(self.model, [ctx.device] * ctx.config.replicas)
        self.wrapped = DataParallel(
            module, ctx,
            bucket_mb=ctx.config.bucket_mb,
            comm_dtype=_COMM_DTYPES[ctx.config.comm_dtype],
            allow_unused=ctx.config.allow_unused_params,
        )
        if ctx.config.zero == 1:
            self.optimizer: torch.optim.Optimizer = ZeroOptimizer(self.wrapped, ctx, optimizer_fn, group_fn=group_fn)
        else:
            self.optimizer = optimizer_fn(parameter_groups(self.model, group_fn))
        self.scheduler = scheduler_fn(self.optimizer) if scheduler_fn else None
        self.grad_clip = grad_clip

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (equal sizes, full-length samples)."""
        comm_before = self.ctx.comm.stats.total_wire_bytes()
        self.model.train()
        self.wrapped.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        count = len(micro_batches)
        loss_sum = torch.zeros((), device=self.ctx.device)
        tokens = 0
        for i, (x, y) in enumerate(micro_batches):
            sync = i == count - 1
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                loss = self.wrapped(x.to(self.ctx.device), y.to(self.ctx.device))
                (loss / count).backward()
            loss_sum += loss.detach()
            tokens += y.numel()
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        totals = torch.stack([loss_sum / count, torch.tensor(float(tokens), device=self.ctx.device)])
        self.ctx.comm.all_reduce(totals, self.ctx.group("dp_cp"))
        dp = self.ctx.group("dp_cp").size
        return StepResult(
            loss=totals[0].item() / dp,
            tokens=int(totals[1].item()),
            grad_norm=grad_norm,
            lr=lr,
            comm_bytes=self.ctx.comm.stats.total_wire_bytes() - comm_before,
        )

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients (buckets and any comm-dtype copies) and
        optimizer state (only its shard under ZeRO; AdamW's state appears after the first step)."""
        gradients = 0
        for bucket in self.wrapped.buckets:
            gradients += tensor_bytes(bucket.flat) + (tensor_bytes(bucket.comm) if bucket.comm is not bucket.flat else 0)
        return {
            "parameters": sum(tensor_bytes(p) for p in self.model.parameters()),
            "gradients": gradients,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    @property
    def sharded_optimizer(self) -> bool:
        """True when each rank holds only its shard of the optimizer state (ZeRO)."""
        return isinstance(self.optimizer, ZeroOptimizer)

    def clip_gradients(self) -> float:
        """Global L2 norm of all gradients (summed over the model-parallel group); clip if configured.

        Same formula as `torch.nn.utils.clip_grad_norm_`: scale by max_norm / (norm + 1e-6) when < 1.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        self.ctx.comm.all_reduce(squares, self.ctx.group("mp"))
        norm = squares.sqrt()
        if self.grad_clip > 0:
            scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale)
        return norm.item()

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """Mean loss and token count over every rank's batches, each token counted exactly once."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for x, y in batches:
            loss = self.model(x.to(self.ctx.device), y.to(self.ctx.device))
            totals[0] += loss.double() * y.numel()
            totals[1] += y.numel()
        self.ctx.comm.all_reduce(totals, self.ctx.group("dp"))
        tokens = int(totals[1].item())
        return (totals[0].item() / tokens if tokens else float("nan")), tokens
