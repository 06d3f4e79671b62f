"""Server j of a parameter-server run (messages.py: roles, shards, messages): holds shard j of the
parameters as the fp32 master, the optimizer built from the same parameter groups as the engine
(`group_fn`, by default no weight decay on vectors), and applies the LR schedule.

What is communicated (point-to-point on the "world" group): the W pushes of a step in, one pull per
push out; in sync with S > 1 the servers also swap their partial Σg² (S(S−1) 4-byte messages), the
squares summed by `grad_norm.local_squares` and clipped by `grad_norm.clip_` as in every strategy.
Consistency modes:
- sync: a server waits for the W pushes of a step, averages them (in worker order), clips by the
  global norm of the average, steps once and answers everyone. Same math as DDP: parity with one
  process.
- async: a server receives whichever push arrives next (`Communicator.recv_any`), applies it
  alone (clipped by its own norm, the push's header) and answers the pushing worker at once.
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
Async rule (async and ssp; `async_lr_scale`, `_reply`): a push carries 1/W of the global batch
and is applied with lr/(W·(1+τ)) — W fresh pushes move the parameters about as far as one sync step
(exactly, for SGD) and stale gradients count less (staleness-aware async SGD, Zhang et al. 2016) —
and the parameters a worker pulls are looked ahead: the server answers with x + τ_w·Δ, where Δ is
the update it applied last and τ_w the staleness of that worker's last gradient, the updates it
will likely apply before the worker's next gradient lands (W − 1 for W balanced workers). The
gradient is so computed about where it is applied: a parameter look-ahead as in DANA (Hakimi et al.
2019) and SpecTrain's weight prediction (Chen et al. 2018), with the last update in place of the
momentum. The server steps its own x; the final answers carry x itself. Adam keeps its β1. Why: a
gradient one update late caps the stable step at lr·curvature < 1 whatever β1 (linearised), where
a fresh one allows 2(1+β1)/(1−β1) = 38, and asynchrony acts as momentum 1 − 1/W on top of Adam's
("Asynchrony begets momentum", Mitliagkas et al. 2016); evaluated at the looked-ahead point the
gradient is fresh to first order. One worker (τ = 0) keeps the full lr and no look-ahead: exactly
single-process training. Measured on the default run (2 workers + 1 server, τ = 1 for 86-92% of the
pushes; validation loss after the same samples; a run's push order alone moves async by
~0.02-0.04): sync 1.478; this rule 1.521, 1.487 and 1.511 (+0.6 to +2.9%), and 1.494 and 1.470
with the look-ahead fixed at W − 1; with that fixed look-ahead and β1 lowered to 0.4, 1.641, or
lr/W (no τ factor), 1.545; β1 0.9 without look-ahead, 1.771. The rule before it (2026-11-22 to
-29) lowered β1 to max(0, β1 − (1 − 1/W)) instead: 1.644-1.659, +11-12% over sync once the data's
per-document EOS and masks had improved sync (1.511 → 1.479) and not async; delay compensation
(DC-ASGD, Zheng et al. 2017) on top of lr/4 had gained nothing in a one-process simulation then.
Cost: Δ, 4Ψ_j bytes per server, and two passes over the shard per update; no bytes on the wire.
Non-finite guard: a push whose header (the worker's ‖g‖², NaN for a non-finite loss) or, in sync,
whose averaged gradient's norm is NaN/inf is not applied. With `skip_nonfinite` it is skipped
(status skipped, counted by the worker); otherwise the server answers "stop" and every rank
raises `NonFiniteError`, the bad gradient never applied (sync: that step updates nothing). Every
server reads the same headers, so all decide alike; in async a server that sees the bad push
answers "stop" to each worker's next push (a worker told "stop" by one server sends one more
header-NaN push to each server that had answered normally, worker.py), then raises.

Cost per round: server j receives W·(4Ψ_j + 4) bytes and sends W·(4Ψ_j + 16). Memory: 4Ψ (the
model it builds; its shard is the master) + 4Ψ_j gradient + an inbox of 4Ψ_j (async, ssp) or
W·4Ψ_j (sync) + 8Ψ_j AdamW state + 4Ψ_j last update (async/ssp with W > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ndtrain.engine import NonFiniteError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.grad_norm import clip_, local_squares
from ndtrain.parallel.data.param_groups import GroupFn, no_decay_for_vectors
from ndtrain.ps.messages import APPLIED, SKIPPED, STOP, OptimizerFn, Outcome, PSSetup, flat_views


def async_lr_scale(workers: int, staleness: int) -> float:
    """The lr factor of one async/ssp push: 1/W (it carries 1/W of the batch) × 1/(1 + τ)."""
    return 1.0 / (workers * (1 + staleness))


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
    """Server j: holds shard j and its optimizer; `serve_step()` serves one step's pushes (sync: one
    round; async/ssp: the next W pushes, whoever sends them), `serve()` all of them."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, setup: PSSetup, optimizer_fn: OptimizerFn, *,
                 group_fn: GroupFn = no_decay_for_vectors, lr_lambda: Callable[[int], float] = lambda k: 1.0,
                 grad_clip: float = 0.0, skip_nonfinite: bool = False) -> None:
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
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.lr_lambda, self.grad_clip, self.skip_nonfinite = lr_lambda, grad_clip, skip_nonfinite
        n = sum(p.numel() for p in self.params)
        device = ctx.device
        self.inbox = [torch.empty(1 + n, device=device) for _ in range(setup.roles.workers if setup.mode == "sync" else 1)]
        self.grad = torch.zeros(n, device=device)
        for p, g in zip(self.params, flat_views(self.grad, self.params)):
            p.grad = g
        # async/ssp with W > 1: the last update applied, Δ (module docstring: the look-ahead)
        self.update = torch.zeros(n, device=device) if setup.mode != "sync" and setup.roles.workers > 1 else None
        self.update_views = flat_views(self.update, self.params) if self.update is not None else []
        self.staleness = [0] * setup.roles.workers     # of each worker's last applied gradient
        self.pushes = [0] * setup.roles.workers        # gradients applied, per worker
        self.pulled = [(0, 0)] * setup.roles.workers   # (version, clock) each worker last pulled
        self.outcomes = [Outcome()] * setup.roles.workers  # what the server did with each worker's last push
        self.waiting: list[int] = []                   # async/ssp: workers whose answer is held back
        self.steps_served = 0
        self.skipped = 0
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
        """Serve every step of every worker; the final parameters answer every last push."""
        while self.steps_served < self.setup.steps:
            self.serve_step()
        return self.report

    def serve_step(self) -> Outcome:
        """Serve one step's worth of pushes (after the last one, answer every worker's last push);
        returns the outcome of the last push handled. Raises `NonFiniteError` (every worker told) on
        a non-finite push without `skip_nonfinite`."""
        step = self.steps_served
        outcome = self._serve_sync(step) if self.setup.mode == "sync" else self._serve_async()
        self.steps_served += 1
        if self.steps_served == self.setup.steps:
            for w in range(self.setup.roles.workers):
                self._reply(w, ahead=False)  # the final parameters themselves
            self.ctx.comm.barrier(self.world)  # the run's end (module docstring)
        return outcome

    def _serve_sync(self, step: int) -> Outcome:
        workers = self.setup.roles.workers
        pending = [self.ctx.comm.recv(self.inbox[w], self.world, w) for w in range(workers)]
        for p in pending:
            p.wait()
        torch.sum(torch.stack([b[1:] for b in self.inbox]), dim=0, out=self.grad)
        self.grad.div_(workers)
        self._record(list(range(workers)))
        finite = bool(torch.stack([b[0] for b in self.inbox]).isfinite().all().item())
        sqnorm = self._global_sqnorm() if finite else float("nan")
        outcome = self._apply(sqnorm, step, 1.0)
        self.outcomes = [outcome] * workers
        self.pushes = [c + 1 for c in self.pushes]
        if outcome.status == STOP:
            self._stop(list(range(workers)), step, outcome)
        if step < self.setup.steps - 1:
            for w in range(workers):
                self._reply(w)
        return outcome

    def _serve_async(self) -> Outcome:
        setup, box = self.setup, self.inbox[0]
        outcome = Outcome()
        for _ in range(setup.roles.workers):
            w = self.ctx.comm.recv_any(box, self.world)
            self.grad.copy_(box[1:])
            self._record([w])
            lr_scale = async_lr_scale(setup.roles.workers, self.report.applications[-1].staleness)
            outcome = self._apply(box[0].item(), self.report.updates // setup.roles.workers, lr_scale)
            self.outcomes[w] = outcome
            self.pushes[w] += 1
            if outcome.status == STOP:
                self._stop([w], self.pushes[w] - 1, outcome)
            if self.pushes[w] < setup.steps:
                self.waiting.append(w)
            for u in list(self.waiting):
                if setup.mode == "async" or self.clock >= self.pushes[u] - setup.staleness:
                    self.waiting.remove(u)
                    self._reply(u)
        return outcome

    def _stop(self, told: list[int], step: int, outcome: Outcome) -> None:
        """Answer "stop" to every worker (`told` have just pushed; in async the others when they next
        push), then raise: no worker waits on this server afterwards."""
        workers = self.setup.roles.workers
        self.outcomes = [outcome] * workers
        done = set(told) | set(self.waiting) | {w for w in range(workers) if self.pushes[w] >= self.setup.steps}
        for w in sorted(done):
            self._reply(w, ahead=False)
        while len(done) < workers:
            w = self.ctx.comm.recv_any(self.inbox[0], self.world)
            if w not in done:
                done.add(w)
                self._reply(w, ahead=False)
        self.ctx.comm.barrier(self.world)  # the run's end (module docstring)
        raise NonFiniteError(step + 1, float("nan"), outcome.grad_norm)

    def _record(self, workers: list[int]) -> None:
        for w in workers:
            version, clock = self.pulled[w]
            self.staleness[w] = self.version - version
            self.report.applications.append(
                Application(w, self.pushes[w], self.staleness[w], self.pushes[w] - clock)
            )

    def _global_sqnorm(self) -> float:
        """Squared norm of the averaged gradient over every shard (servers swap their partials)."""
        mine = local_squares([(self.grad, 1.0)], self.ctx.device).reshape(1)
        servers = self.setup.roles.servers
        if servers == 1:
            return mine.item()
        others = {j: torch.empty(1, device=self.ctx.device) for j in range(servers) if j != self.index}
        peers = [(mine, self.setup.roles.server_rank(j)) for j in others]
        recvs = [(t, self.setup.roles.server_rank(j)) for j, t in others.items()]
        self.ctx.comm.batch_send_recv(peers, recvs, self.world).wait()
        others[self.index] = mine
        return sum(others[j].item() for j in range(servers))

    @torch.no_grad()
    def _apply(self, sqnorm: float, schedule_step: int, lr_scale: float) -> Outcome:
        """Clip (by `sqnorm`, the squared norm the step's gradient has over every shard) and step,
        unless the norm is not finite (the guard: skipped or stop, nothing updated)."""
        norm = sqnorm**0.5 if sqnorm >= 0 else float("nan")
        multiplier = self.lr_lambda(schedule_step) * lr_scale
        lr = self.base_lrs[0] * multiplier
        if not math.isfinite(norm):
            if not self.skip_nonfinite:
                return Outcome(norm, lr, STOP)
            self.skipped += 1
            return Outcome(norm, lr, SKIPPED)
        if self.grad_clip > 0:
            clip_([self.grad], torch.tensor(norm, dtype=self.grad.dtype, device=self.grad.device), self.grad_clip)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * multiplier
        if self.update is None:
            self.optimizer.step()
        else:  # Δ = x after − x before
            for u, p in zip(self.update_views, self.params):
                u.copy_(p)
            self.optimizer.step()
            for u, p in zip(self.update_views, self.params):
                u.sub_(p).neg_()
        self.report.updates += 1
        return Outcome(norm, lr, APPLIED)

    def _reply(self, worker: int, ahead: bool = True) -> None:
        """Answer `worker` with the header and shard j's parameters: in async/ssp mid-run, moved ahead
        by the worker's last staleness times the last update (module docstring: the look-ahead)."""
        o = self.outcomes[worker]
        header = torch.tensor([float(self.version), o.grad_norm, o.lr, float(o.status)], device=self.ctx.device)
        message = torch.cat([header, *(p.detach().reshape(-1) for p in self.params)])
        steps = self.staleness[worker] if ahead and self.update is not None else 0
        if steps:
            message[len(header):].add_(self.update, alpha=float(steps))
        self.pulled[worker] = (self.version, self.clock)
        self.ctx.comm.send(message, self.world, worker).wait()
