"""Parameter-server training: S server ranks own the parameters and the optimizer; W worker ranks
pull parameters, compute gradients on their data and push them (BytePS/DistBelief-style push/pull).

Roles: in a world of S + W ranks the workers are ranks 0..W−1 (so rank 0, which logs, is a
worker) and the servers the last S ranks, W..W+S−1 (`Roles`).

What is split: the parameters, by whole tensors, into S shards balanced by bytes (largest tensor
first to the least loaded server, `shard_parameters`). Server j holds the fp32 master copy of its
shard, the optimizer built from the same parameter groups as the engine (`group_fn`, by default
no weight decay on vectors) and applies the LR schedule. Every rank builds the whole model from
the same seed, so workers start from the servers' parameters without an initial pull.

What is communicated, and when (all point-to-point on the "world" group, through `ctx.comm`):
- push: after forward/backward, worker w sends server j one fp32 message
  [‖g_w‖², g_w restricted to shard j] (the squared norm of its whole local gradient, for
  per-push clipping in async/ssp);
- pull: server j answers with [version, shard j's parameters]; the worker copies them into its
  model and starts its next step. The reply to a worker's last push is sent when every push of
  every worker has been applied (the final parameters, used for evaluation).
Consistency modes:
- sync: a server waits for the W pushes of a step, averages them (in worker order), clips by the
  global norm of the average (servers exchange their partial squared norms when S > 1: S(S−1)
  4-byte messages), steps once and answers everyone. Same math as DDP: parity with one process.
- async: a server receives whichever push arrives next (`Communicator.recv_any`), applies it
  alone (clipped by its own norm) and answers the pushing worker at once.
- ssp(s): as async, but the answer to a worker that has pushed c gradients is held back until
  the slowest worker has pushed at least c − s: no worker computes more than s steps ahead.
Version, staleness and clock: a server's version is the number of updates it has applied (= the
step in sync); its clock is min over workers of the pushes applied. The staleness τ of an applied
gradient is the standard one (Zhang et al. 2016): the updates the server applied between the
worker's pull and this application. sync: always 0; W balanced async workers: W − 1; one worker:
0 (async and ssp are then exactly single-process training). ssp bounds the clock lead instead,
the gradient's step minus the clock the worker pulled (≤ s by construction), which is recorded
next to τ. Each server records every application. LR schedule: the multiplier of schedule step k,
with k = the step in sync and k = (updates applied) // W in async/ssp, so the schedule spans the
same number of samples.
Async rule (async and ssp; `async_lr_scale`, `async_beta1`): a push carries 1/W of the global
batch and is applied with lr/(W·(1+τ)) — W fresh pushes move the parameters about as far as one
sync step (exactly, for SGD) and stale gradients count less (staleness-aware async SGD, Zhang et
al. 2016) — and the server's Adam runs with β1' = max(0, β1 − (1 − 1/W)). Why: asynchrony itself
acts as momentum 1 − 1/W ("Asynchrony begets momentum", Mitliagkas et al. 2016); on top of Adam's
β1 = 0.9 the total is too much. Linearised, a gradient one update late caps the stable step at
lr·curvature < 1 whatever β1, where a fresh one allows 2(1+β1)/(1−β1) = 38: under delay β1's
stability gain is gone and only its lag is left. One worker keeps β1 and the full lr (exactly
single-process training). Cost: none (no state, no bytes). Measured on the default run (2
workers + 1 server, staleness 1 for ~95% of pushes): sync 1.508; this rule 1.644 and 1.633
(+9%, two runs). A one-process simulation of delay-1 round robin: full lr and β1 2.30; lr/4 and
β1 1.83; lr/4 and β1 0.5 or 0: 1.64 and 1.63; delay compensation (DC-ASGD, Zheng et al. 2017,
λ0 = 2) on top of lr/4 gained nothing (1.82).

Straggler: `slow_worker=(rank, F)` makes that worker wait (F−1)× its measured compute time after
each backward (an experiment knob: the wait is the feature, not synchronisation).

Cost per worker step, with Ψ parameter elements (fp32): a worker sends 4Ψ + 4S bytes and
receives 4Ψ + 4S; server j sends and receives W·(4Ψ_j + 4) per round, so its link carries
2W·4Ψ/S bytes per step: the servers' bandwidth, not the workers', bounds the step once W > S.
Memory: workers 4Ψ parameters + 4Ψ gradients + 8Ψ push and pull buffers, no optimizer state; server j
4Ψ (the model it builds; its shard is the master) + 4Ψ_j gradient + an inbox of 4Ψ_j (async,
ssp) or W·4Ψ_j (sync) + 8Ψ_j AdamW state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ndtrain.config import PSConfig
from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.parallel.zero1_optimizer import GroupFn, no_decay_for_vectors

Batch = tuple[torch.Tensor, torch.Tensor]
OptimizerFn = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


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
        sizes = [p.numel() * p.element_size() for p in _params(model)]
        return cls(ps.mode, steps, roles, shard_parameters(sizes, ps.servers), ps.staleness, ps.straggler())


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _flat_views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def async_lr_scale(workers: int, staleness: int) -> float:
    """The lr factor of one async/ssp push: 1/W (it carries 1/W of the batch) × 1/(1 + τ)."""
    return 1.0 / (workers * (1 + staleness))


def async_beta1(beta1: float, workers: int) -> float:
    """The server's Adam β1 under asynchrony: W asynchronous workers add momentum 1 − 1/W
    (Mitliagkas et al. 2016), taken out of the explicit one so the total stays β1 (floor 0)."""
    return max(0.0, beta1 - (1.0 - 1.0 / workers))


@dataclass
class Application:
    """One gradient applied by a server: `staleness` = updates the server applied between the
    worker's pull and this application; `lead` = the worker's step minus the clock it pulled."""

    worker: int
    step: int
    staleness: int
    lead: int


@dataclass
class ServerReport:
    applications: list[Application] = field(default_factory=list)
    updates: int = 0


class ParameterServer:
    """Server j: holds shard j and its optimizer; `serve()` runs until every push is applied."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, setup: PSSetup, optimizer_fn: OptimizerFn, *,
                 group_fn: GroupFn = no_decay_for_vectors, lr_lambda: Callable[[int], float] = lambda k: 1.0,
                 grad_clip: float = 0.0) -> None:
        self.ctx, self.setup = ctx, setup
        self.world = ctx.group("world")
        self.index = ctx.rank - setup.roles.workers
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [named[i][1] for i in setup.shards[self.index]]
        groups: dict[tuple, dict[str, Any]] = {}
        for i in setup.shards[self.index]:
            name, p = named[i]
            opts = dict(group_fn(name, p))
            groups.setdefault(tuple(sorted(opts.items())), {"params": [], **opts})["params"].append(p)
        self.optimizer = optimizer_fn(list(groups.values()))
        if setup.mode != "sync":
            for group in self.optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (async_beta1(group["betas"][0], setup.roles.workers), *group["betas"][1:])
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.lr_lambda, self.grad_clip = lr_lambda, grad_clip
        n = sum(p.numel() for p in self.params)
        self.inbox = [torch.empty(1 + n) for _ in range(setup.roles.workers if setup.mode == "sync" else 1)]
        self.grad = torch.zeros(n)
        for p, g in zip(self.params, _flat_views(self.grad, self.params)):
            p.grad = g
        self.pushes = [0] * setup.roles.workers        # gradients applied, per worker
        self.pulled = [(0, 0)] * setup.roles.workers   # (version, clock) each worker last pulled
        self.report = ServerReport()

    @property
    def version(self) -> int:
        """Updates applied so far (the parameters' version)."""
        return self.report.updates

    @property
    def clock(self) -> int:
        """Pushes applied of the slowest worker."""
        return min(self.pushes)

    def serve(self) -> ServerReport:
        if self.setup.mode == "sync":
            self._serve_sync()
        else:
            self._serve_async()
        for w in range(self.setup.roles.workers):  # the final parameters answer every last push
            self._reply(w)
        return self.report

    def _serve_sync(self) -> None:
        workers = self.setup.roles.workers
        for step in range(self.setup.steps):
            pending = [self.ctx.comm.recv(self.inbox[w], self.world, w) for w in range(workers)]
            for p in pending:
                p.wait()
            torch.sum(torch.stack([b[1:] for b in self.inbox]), dim=0, out=self.grad)
            self.grad.div_(workers)
            self._record(list(range(workers)))
            self._apply(self._global_sqnorm(), step, 1.0)
            self.pushes = [c + 1 for c in self.pushes]
            if step < self.setup.steps - 1:
                for w in range(workers):
                    self._reply(w)

    def _serve_async(self) -> None:
        setup, box = self.setup, self.inbox[0]
        waiting: list[int] = []
        for _ in range(setup.roles.workers * setup.steps):
            w = self.ctx.comm.recv_any(box, self.world)
            self.grad.copy_(box[1:])
            self._record([w])
            lr_scale = async_lr_scale(setup.roles.workers, self.report.applications[-1].staleness)
            self._apply(box[0].item(), self.report.updates // setup.roles.workers, lr_scale)
            self.pushes[w] += 1
            if self.pushes[w] < setup.steps:
                waiting.append(w)
            for u in list(waiting):
                if setup.mode == "async" or self.clock >= self.pushes[u] - setup.staleness:
                    waiting.remove(u)
                    self._reply(u)

    def _record(self, workers: list[int]) -> None:
        for w in workers:
            version, clock = self.pulled[w]
            self.report.applications.append(
                Application(w, self.pushes[w], self.version - version, self.pushes[w] - clock)
            )

    def _global_sqnorm(self) -> float:
        """Squared norm of the averaged gradient over every shard (servers swap their partials)."""
        mine = self.grad.pow(2).sum().reshape(1)
        servers = self.setup.roles.servers
        if servers == 1:
            return mine.item()
        others = {j: torch.empty(1) for j in range(servers) if j != self.index}
        peers = [(mine, self.setup.roles.server_rank(j)) for j in others]
        recvs = [(t, self.setup.roles.server_rank(j)) for j, t in others.items()]
        self.ctx.comm.batch_send_recv(peers, recvs, self.world).wait()
        others[self.index] = mine
        return sum(others[j].item() for j in range(servers))

    @torch.no_grad()
    def _apply(self, sqnorm: float, schedule_step: int, lr_scale: float) -> None:
        if self.grad_clip > 0:
            scale = min(1.0, self.grad_clip / (sqnorm**0.5 + 1e-6))
            if scale < 1.0:
                self.grad.mul_(scale)
        multiplier = self.lr_lambda(schedule_step) * lr_scale
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * multiplier
        self.optimizer.step()
        self.report.updates += 1

    def _reply(self, worker: int) -> None:
        message = torch.cat([torch.tensor([float(self.version)]), *(p.detach().reshape(-1) for p in self.params)])
        self.pulled[worker] = (self.version, self.clock)
        self.ctx.comm.send(message, self.world, worker).wait()


@dataclass
class WorkerReport:
    steps: int = 0
    seconds: float = 0.0          # wall time of the steps (compute, straggler wait, push, pull but the last)
    versions: list[int] = field(default_factory=list)  # version pulled from server 0 after each push

    @property
    def pushes_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


class PSWorker:
    """Worker w: `train_step(micro_batches)` = forward/backward, push to every server, pull."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, setup: PSSetup) -> None:
        self.model, self.ctx, self.setup = model, ctx, setup
        self.world = ctx.group("world")
        params = _params(model)
        self.shards = [[params[i] for i in shard] for shard in setup.shards]
        self.outbox = [torch.empty(1 + sum(p.numel() for p in s)) for s in self.shards]
        self.inbox = [torch.empty_like(b) for b in self.outbox]
        self.grad_views = [_flat_views(box[1:], s) for box, s in zip(self.outbox, self.shards)]
        self.param_views = [_flat_views(box[1:], s) for box, s in zip(self.inbox, self.shards)]
        self.slow = setup.slow_worker[1] if setup.slow_worker and setup.slow_worker[0] == ctx.rank else 1.0
        self.report = WorkerReport()

    def train_step(self, micro_batches: Sequence[Batch]) -> float:
        """One push/pull round on this worker's micro-batches; returns its mean loss."""
        started = time.perf_counter()
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for x, y in micro_batches:
            loss = self.model(x.to(self.ctx.device), y.to(self.ctx.device))
            (loss / len(micro_batches)).backward()
            loss_sum += loss.item()
        if self.slow > 1.0:  # the straggler knob: stretch this worker's compute FACTOR×
            time.sleep((self.slow - 1.0) * (time.perf_counter() - started))
        final = self.report.steps == self.setup.steps - 1
        pushed = self._push_pull()
        self.report.steps += 1  # the last step's clock stops at its push: the final pull waits for everyone
        self.report.seconds += (pushed if final else time.perf_counter()) - started
        return loss_sum / len(micro_batches)

    @torch.no_grad()
    def _push_pull(self) -> float:
        """Push to every server, pull from every server; returns the time the pushes were done."""
        for shard, views in zip(self.shards, self.grad_views):
            for p, v in zip(shard, views):
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
        sqnorm = sum(box[1:].double().pow(2).sum() for box in self.outbox).item()
        server = self.setup.roles.server_rank
        sends = []
        for j, box in enumerate(self.outbox):
            box[0] = sqnorm
            sends.append(self.ctx.comm.send(box, self.world, server(j)))
        recvs = [self.ctx.comm.recv(box, self.world, server(j)) for j, box in enumerate(self.inbox)]
        for pending in sends:
            pending.wait()
        pushed = time.perf_counter()
        for pending in recvs:
            pending.wait()
        for shard, views in zip(self.shards, self.param_views):
            for p, v in zip(shard, views):
                p.copy_(v)
        self.report.versions.append(int(self.inbox[0][0].item()))
        return pushed
