"""Worker w of a parameter-server run (messages.py: roles, shards, messages): trains on its share
of the global batch and holds no optimizer state.

One step (`PSWorker.train_step`): forward/backward over the worker's micro-batches, Σg² of its whole
local gradient (`grad_norm.local_squares`, accumulated in float64: the push header that async/ssp
servers clip by), push [Σg², its gradient restricted to shard j] to every server j, pull
[version, norm, lr, status, shard j's parameters] from each and copy the parameters into the
model (in async/ssp, mid-run, the parameters looked ahead by the server: server.py). A loss that
is not finite sends a NaN header (the servers' guard, server.py); a worker told "stop" by one
server sends one more header-NaN push to each server that had answered normally, so none waits
for it, then every rank raises `NonFiniteError` after the run's end barrier.

Straggler: `slow_worker=(rank, F)` makes that worker wait (F−1)× its measured compute time after
each backward (an experiment knob: the wait is the feature, not synchronisation).

Host synchronisation: one device→host read per round (the mean loss with the servers' answer
headers, after the pull), none per micro-batch; the loss's finiteness reaches the push header on
the device. Buffers live on `ctx.device` (NCCL sends device tensors: no host staging to pin).

Cost per step, with Ψ parameter elements (fp32) and S servers: sends 4Ψ + 4S bytes, receives
4Ψ + 16S. Memory: 4Ψ parameters + 4Ψ gradients + 8Ψ push and pull buffers, no optimizer state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ndtrain.engine import NonFiniteError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.grad_norm import local_squares
from ndtrain.parallel.target_mean import target_count
from ndtrain.ps.messages import (
    PULL_HEADER, SKIPPED, STOP, Batch, LossFn, Outcome, PSSetup, flat_views, trainable_parameters,
)


@dataclass
class WorkerReport:
    steps: int = 0
    seconds: float = 0.0          # wall time of the steps (compute, straggler wait, push, pull but the last)
    versions: list[int] = field(default_factory=list)  # version pulled from server 0 after each push
    skipped: int = 0              # pushes the servers skipped (non-finite, `skip_nonfinite`)

    @property
    def pushes_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


class PSWorker:
    """Worker w: `train_step(micro_batches)` = forward/backward, push to every server, pull.
    `loss_fn(output, targets)`: as the engine's (None: `model(tokens, targets)` is the loss)."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, setup: PSSetup, loss_fn: LossFn | None = None) -> None:
        self.model, self.ctx, self.setup, self.loss_fn = model, ctx, setup, loss_fn
        self.world = ctx.group("world")
        params = trainable_parameters(model)
        self.shards = [[params[i] for i in shard] for shard in setup.shards]
        self.outbox = [torch.empty(1 + sum(p.numel() for p in s), device=ctx.device) for s in self.shards]
        self.inbox = [torch.empty(PULL_HEADER - 1 + len(b), device=ctx.device) for b in self.outbox]
        self.grad_views = [flat_views(box[1:], s) for box, s in zip(self.outbox, self.shards)]
        self.param_views = [flat_views(box[PULL_HEADER:], s) for box, s in zip(self.inbox, self.shards)]
        self.slow = setup.slow_worker[1] if setup.slow_worker and setup.slow_worker[0] == ctx.rank else 1.0
        self.outcome = Outcome()  # server 0's answer to the last push
        self.report = WorkerReport()

    def train_step(self, micro_batches: Sequence[Batch]) -> float:
        """One push/pull round on this worker's micro-batches; returns its mean loss over their targets
        (parallel/target_mean.py; packed documents' positions reach the model). Raises
        `NonFiniteError` when the servers answer "stop" (nothing updated)."""
        started = time.perf_counter()
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss_mean_t = torch.zeros((), dtype=torch.float64, device=self.ctx.device)  # on the device: no read per micro-batch
        inputs = [[t.to(self.ctx.device, non_blocking=True) for t in batch] for batch in micro_batches]
        counts = torch.stack([target_count(batch[1]) for batch in inputs])
        weights = counts / counts.sum().clamp(min=1.0)  # each micro-batch's share of this worker's targets
        for (x, y, *positions), weight in zip(inputs, weights):
            loss = self.model(x, y, *positions) if self.loss_fn is None else self.loss_fn(self.model(x), y)
            loss = loss * weight.to(loss.dtype)
            loss.backward()
            loss_mean_t += loss.detach().double()
        if self.slow > 1.0:  # the straggler knob: stretch this worker's compute FACTOR× (reading the loss
            loss_mean_t.item()  # waits for the compute, so the clock measures it on CUDA too)
            time.sleep((self.slow - 1.0) * (time.perf_counter() - started))
        final = self.report.steps == self.setup.steps - 1
        pushed, loss_mean = self._push_pull(loss_mean_t)
        if self.outcome.status == STOP:
            self.ctx.comm.barrier(self.world)  # the run's end (module docstring)
            raise NonFiniteError(self.report.steps + 1, loss_mean, self.outcome.grad_norm)
        self.report.skipped += self.outcome.status == SKIPPED
        self.report.steps += 1  # the last step's clock stops at its push: the final pull waits for everyone
        self.report.seconds += (pushed if final else time.perf_counter()) - started
        if final:
            self.ctx.comm.barrier(self.world)  # the run's end (module docstring)
        return loss_mean

    @torch.no_grad()
    def _push_pull(self, loss_mean: torch.Tensor) -> tuple[float, float]:
        """Push to every server, pull from every server; returns the time the pushes were done and the
        worker's mean loss, read from the device with the servers' answers (one read per round)."""
        for shard, views in zip(self.shards, self.grad_views):
            for p, v in zip(shard, views):
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
        sqnorm = local_squares([(box[1:].double(), 1.0) for box in self.outbox], self.ctx.device)  # float64
        header = torch.where(loss_mean.isfinite(), sqnorm, torch.full_like(sqnorm, float("nan")))  # NaN: the guard
        for box in self.outbox:
            box[0] = header
        pushed = self._exchange(range(len(self.outbox)))
        read = torch.cat([loss_mean.reshape(1).double(),
                          *(box[:PULL_HEADER].double() for box in self.inbox)]).tolist()
        mean, heads = read[0], [read[1 + j * PULL_HEADER : 1 + (j + 1) * PULL_HEADER] for j in range(len(self.inbox))]
        statuses = [int(head[PULL_HEADER - 1]) for head in heads]
        if STOP in statuses:  # tell the servers that answered normally, so none waits for this worker
            self.outcome = Outcome(heads[0][1], heads[0][2], STOP)
            for box in self.outbox:
                box[0] = float("nan")
            self._exchange([j for j, s in enumerate(statuses) if s != STOP])
            return pushed, mean
        for shard, views in zip(self.shards, self.param_views):
            for p, v in zip(shard, views):
                p.copy_(v)
        self.outcome = Outcome(heads[0][1], heads[0][2], statuses[0])
        self.report.versions.append(int(heads[0][0]))
        return pushed, mean

    def _exchange(self, servers: Sequence[int]) -> float:
        """Push to and pull from `servers`; returns the time the pushes were done."""
        server = self.setup.roles.server_rank
        sends = [self.ctx.comm.send(self.outbox[j], self.world, server(j)) for j in servers]
        recvs = [self.ctx.comm.recv(self.inbox[j], self.world, server(j)) for j in servers]
        for pending in sends:
            pending.wait()
        pushed = time.perf_counter()
        for pending in recvs:
            pending.wait()
        return pushed
