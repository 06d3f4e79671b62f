"""What the servers and workers of a parameter-server run agree on: who is who, which server owns
which parameters, and the two messages they exchange (BytePS/DistBelief-style push/pull).

Roles: in a world of S + W ranks the workers are ranks 0..W−1 (so rank 0, which logs, is a
worker) and the servers the last S ranks, W..W+S−1 (`Roles`).

What is split: the parameters, by whole tensors, into S shards balanced by bytes (largest tensor
first to the least loaded server, `shard_parameters`); server j owns shard j (server.py). Every
rank builds the whole model from the same seed, so workers start from the servers' parameters
without an initial pull.

What is communicated, and when (all point-to-point on the "world" group, through `ctx.comm`):
- push: after forward/backward, worker w sends server j one fp32 message
  [‖g_w‖², g_w restricted to shard j] (the squared norm of its whole local gradient, for
  per-push clipping in async/ssp; NaN when the worker's loss is not finite, for the guard);
- pull: server j answers with [version, gradient norm, lr, status, shard j's parameters]
  (`PULL_HEADER` numbers, then the shard; the norm and lr the server used on that push, `Outcome`;
  status `APPLIED` / `SKIPPED` / `STOP`); the worker copies the parameters into its model and starts
  its next step. The reply to a worker's last push is sent when every push of every worker has been
  applied (the final parameters, used for evaluation).
- end: every rank leaves a run (after its last step, or before raising on "stop") through one world
  barrier. Pushes travel on the world group's point-to-point channel, which the next run (another
  `PSSetup` on the same ranks) uses too; a server still receiving from any source in this run would
  take a push of the next one, sent by a rank that was done with this run (a deadlock: that push
  never reaches the next run's server). Cost: one barrier per run.
Buffers (pushes, pulls, the server's flat gradient and inbox) live on `ctx.device`, so NCCL
sends and receives device tensors; async/ssp need a receive from any source, which gloo has and
NCCL lacks (refused there with one line, engine.py).

Cost per worker step, with Ψ parameter elements (fp32): a worker sends 4Ψ + 4S bytes and
receives 4Ψ + 16S; server j receives W·(4Ψ_j + 4) and sends W·(4Ψ_j + 16) per round, so its link
carries 2W·4Ψ/S bytes per step: the servers' bandwidth, not the workers', bounds the step once W > S.
Nothing in this file communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ndtrain.config import PSConfig
from ndtrain.dist.mesh import ParallelContext
from ndtrain.errors import UserError

Batch = tuple[torch.Tensor, ...]  # (tokens, targets[, positions]): trainer.stack
OptimizerFn = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
PULL_HEADER = 4  # version, gradient norm, lr, status
APPLIED, SKIPPED, STOP = 0, 1, 2  # a push's status in the server's answer


@dataclass(frozen=True)
class Roles:
    """Who is who in a world of `servers` + `workers` ranks (servers last)."""

    servers: int
    workers: int

    def server_rank(self, j: int) -> int:
        return self.workers + j

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers


def shard_parameters(sizes: Sequence[int], servers: int) -> list[list[int]]:
    """Parameter indices per server: whole tensors, largest first to the least loaded server
    (ties to the lower server), each shard kept in model order."""
    if servers > len(sizes):
        raise UserError(f"ps.servers={servers} exceeds the model's {len(sizes)} parameter tensors: use fewer servers")
    load = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(servers), key=lambda j: (load[j], j))
        load[j] += sizes[i]
        shards[j].append(i)
    return [sorted(s) for s in shards]


@dataclass
class PSSetup:
    """What servers and workers agree on: mode, steps per worker, the shards and the straggler."""

    mode: str
    steps: int
    roles: Roles
    shards: list[list[int]]
    staleness: int = 0
    slow_worker: tuple[int, float] | None = None

    @classmethod
    def build(cls, model: nn.Module, ctx: ParallelContext, ps: PSConfig, steps: int) -> "PSSetup":
        """The setup of `ps` (validated against the world) for `steps` pushes per worker."""
        ps.validate()
        ps.check_world(ctx.world_size)
        roles = Roles(ps.servers, ctx.world_size - ps.servers)
        sizes = [p.numel() * p.element_size() for p in trainable_parameters(model)]
        return cls(ps.mode, steps, roles, shard_parameters(sizes, ps.servers), ps.staleness, ps.straggler())


@dataclass(frozen=True)
class Outcome:
    """What a server did with one push: the gradient norm and lr it used, and the status."""

    grad_norm: float = float("nan")
    lr: float = float("nan")
    status: int = APPLIED


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the run trains, in model order: what the shards index."""
    return [p for p in model.parameters() if p.requires_grad]


def flat_views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `params`, end to end: a shard's part of a message."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views
