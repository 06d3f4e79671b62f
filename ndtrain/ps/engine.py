"""`PSEngine`: parameter-server training (messages.py, server.py, worker.py) behind the `Engine` interface.

Every rank builds the whole model from the same seed on `ctx.device`. Worker ranks (0..W−1):
`train_step` runs forward/backward on the rank's micro-batches, pushes the gradient to the
servers and pulls the parameters, and returns a `StepResult` (this worker's mean loss over its
targets: a worker's micro-batches are weighted by their targets, but the servers average the
workers' gradients, so across workers a target weighs by its worker's share, not as one of the
global batch's, unlike `Engine` (parallel/target_mean.py); async/ssp have no global batch; the
tokens of one global batch, W workers' shares; the gradient norm and lr the servers used; the
bytes this rank sent). Server ranks (the last S): `train_step` is given no batches (the loop loads none for them) and serves one
step's worth of pushes (sync: one round; async/ssp: the next W pushes, whoever sends them), so the
`Trainer` runs the same loop on every rank. Evaluation: workers evaluate their shard of the
validation batches with the parameters they hold (after the last step: the final ones); servers
add zeros to the one world all-reduce of loss, token count and accuracy tally.
Not supported (one-line `UserError`): checkpoints (`save`/`load`: the optimizer state is split
by whole tensors over the servers, and async workers never hold one consistent version), zero,
single-process dp, tp/pp/cp, mixed precision; async/ssp on NCCL (no receive from any source).
`summary()` (collective) gathers the run's PS figures with one world all-reduce of
2W + (W + 1)·steps + 1 float64 numbers: pushes/s per worker, the workers' last losses, the
staleness histogram (one entry per gradient applied, summed over servers), the largest clock lead.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ndtrain.config import TrainConfig
from ndtrain.engine import Batch, StepResult
from ndtrain.errors import UserError
from ndtrain.eval.token_metrics import Evaluation, Tally, scoring
from ndtrain.dist.memory import optimizer_state_bytes, peak_bytes, tensor_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.pipeline import Timeline
from ndtrain.parallel.counting import count_parameters
from ndtrain.ps.messages import LossFn, OptimizerFn, PSSetup
from ndtrain.ps.server import ParameterServer
from ndtrain.models.hf_parallel import takes_positions
from ndtrain.ps.worker import PSWorker
from ndtrain.parallel.target_mean import target_count
from ndtrain.parallel.data.param_groups import GroupFn, no_decay_for_vectors

NO_CHECKPOINTS = ("checkpoints are not supported in parameter-server training (ps.servers > 0): the optimizer state "
                  "lives on the servers and async workers hold no single version; train without ps.servers to checkpoint")


def check_ps_config(cfg: TrainConfig, world_size: int) -> int:
    """Refuse what parameter-server mode does not combine with; return the number of workers."""
    cfg.ps.check_world(world_size)
    p = cfg.parallel
    unsupported = {
        "parallel.zero": p.zero != 0,
        "parallel.dp_mode=single-process": p.dp_mode != "ddp",
        "parallel.tp/pp/cp": p.tp * p.pp * p.cp > 1,
        f"parallel.precision={p.precision}": p.precision != "fp32",
        "checkpoint.resume (--resume)": cfg.checkpoint.resume,
        "checkpoint.save_every": cfg.checkpoint.save_every != 0,
        "checkpoint.exit_after": cfg.checkpoint.exit_after != 0,
    }
    for option, requested in unsupported.items():
        if requested:
            raise UserError(f"{option} does not combine with parameter-server training (ps.servers > 0): leave it at its default")
    return world_size - cfg.ps.servers


class PSEngine:
    """One rank of a parameter-server run: a worker or a server, driven like `Engine`."""

    def __init__(self, model_fn: Callable[[], nn.Module], optimizer_fn: OptimizerFn, ctx: ParallelContext,
                 cfg: TrainConfig, *, group_fn: GroupFn = no_decay_for_vectors,
                 lr_lambda: Callable[[int], float] = lambda k: 1.0, loss_fn: LossFn | None = None) -> None:
        """`cfg.ps` the mode, `cfg.schedule.steps` the steps of every worker, `cfg.optim` the clip
        and non-finite guard; `optimizer_fn`/`group_fn`/`lr_lambda` as `Engine`'s (on the servers)."""
        self.workers = check_ps_config(cfg, ctx.world_size)
        if cfg.ps.mode != "sync" and ctx.backend == "nccl":
            raise UserError(f"ps.mode={cfg.ps.mode} needs a receive from any worker, which NCCL lacks: "
                            "use parallel.backend=gloo or ps.mode=sync")
        self.ctx = ctx
        self.model = model_fn().to(ctx.device)
        self.parameter_count = count_parameters(self.model)
        self.trainable_count = count_parameters(self.model, trainable=True)
        self.setup = PSSetup.build(self.model, ctx, cfg.ps, cfg.schedule.steps)
        self.is_server = self.setup.roles.is_server(ctx.rank)
        self.loss_fn, self.slow_worker = loss_fn, cfg.ps.slow_worker
        self.takes_positions = loss_fn is None and takes_positions(self.model, None)  # a worker hands its own loss them
        self.scheduler = None  # the servers apply the LR schedule themselves (async: by updates applied)
        self.timeline: Timeline | None = None  # no pipeline timeline to record
        self.sharded_model = None
        self.server: ParameterServer | None = None
        self.worker: PSWorker | None = None
        if self.is_server:
            self.server = ParameterServer(self.model, ctx, self.setup, optimizer_fn, group_fn=group_fn,
                                          lr_lambda=lr_lambda, grad_clip=cfg.optim.grad_clip,
                                          skip_nonfinite=cfg.optim.skip_nonfinite)
        else:
            self.worker = PSWorker(self.model, ctx, self.setup, loss_fn)
        self.optimizer = self.server.optimizer if self.server else None
        self.last_loss = float("nan")

    # ----------------------------------------------------------------------------- training
    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """Worker: one push/pull round; server: serve one step's pushes (its batches unused)."""
        comm_before = self.ctx.comm.stats.total_wire_bytes()
        if self.server is not None:
            outcome = self.server.serve_step()
            return StepResult(loss=float("nan"), tokens=0, grad_norm=outcome.grad_norm, lr=outcome.lr,
                              comm_bytes=self.ctx.comm.stats.total_wire_bytes() - comm_before,
                              skipped=outcome.status != 0)
        assert self.worker is not None
        self.last_loss = self.worker.train_step(micro_batches)
        outcome = self.worker.outcome
        return StepResult(
            loss=self.last_loss, tokens=sum(batch[1].numel() for batch in micro_batches) * self.workers,
            grad_norm=outcome.grad_norm, lr=outcome.lr,
            comm_bytes=self.ctx.comm.stats.total_wire_bytes() - comm_before, skipped=outcome.status != 0,
        )

    @property
    def skipped_steps(self) -> int:
        """Pushes not applied because of a non-finite loss or gradient norm (`optim.skip_nonfinite`)."""
        return self.server.skipped if self.server else self.worker.report.skipped

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> Evaluation:
        """Mean loss, token count and next-token accuracy (eval/token_metrics.py) over the workers' batches
        (servers read none); one 32-byte all-reduce over the world."""
        totals = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)  # Σ loss·count, count, correct, counted
        if self.worker is not None:
            self.model.eval()
            with scoring(self.model) if self.loss_fn is None else contextlib.nullcontext(Tally()) as tally:
                for batch in batches:
                    x, y, *positions = (t.to(self.ctx.device) for t in batch)
                    loss = self.model(x, y, *positions) if self.loss_fn is None else self.loss_fn(self.model(x), y)
                    count = target_count(y)
                    totals[0] += loss.double() * count
                    totals[1] += count
                totals[2:] += tally.take(self.ctx.device)
        self.ctx.comm.all_reduce(totals, self.ctx.group("world"))
        loss_sum, tokens, correct, counted = totals.tolist()
        return Evaluation(loss=loss_sum / tokens if tokens else float("nan"), tokens=int(tokens),
                          accuracy=correct / counted if counted else None)

    # ----------------------------------------------------------------------------- inspection
    def model_state_bytes(self) -> dict[str, int]:
        """Worker: the model, its gradients and the push/pull buffers (no optimizer). Server: the
        model (its shard is the master), the shard's gradient and inbox, AdamW's state of the shard."""
        parameters = sum(tensor_bytes(p) for p in self.model.parameters())
        if self.server is not None:
            gradients = tensor_bytes(self.server.grad) + sum(tensor_bytes(b) for b in self.server.inbox)
            return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state_bytes(self.optimizer)}
        w = self.worker
        buffers = sum(tensor_bytes(b) for b in w.outbox + w.inbox)
        grads = sum(tensor_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        return {"parameters": parameters, "gradients": grads + buffers, "optimizer": 0}

    def memory_bytes(self) -> dict[str, int]:
        return {**self.model_state_bytes(), "peak": peak_bytes(self.ctx.device)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as this rank holds them: on a worker the parameters it last pulled
        (after the last step: the final ones); on a server only its shard is current."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def extra_state(self) -> dict[str, Any]:
        return {"nonfinite_skips": self.skipped_steps}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        raise UserError(NO_CHECKPOINTS)

    def save(self, path: str | Path, **_: Any) -> Path:
        raise UserError(NO_CHECKPOINTS)

    def load(self, path: str | Path, **_: Any) -> dict[str, Any]:
        raise UserError(NO_CHECKPOINTS)

    # ----------------------------------------------------------------------------- the run's figures
    def summary(self) -> dict[str, Any]:
        """The PS figures of the run (collective over the world, once at the end): see the module docstring."""
        ctx, w, steps = self.ctx, self.workers, self.setup.steps
        leads = 2 * w + w * steps  # the histograms: staleness < W·steps, clock lead < steps
        stats = torch.zeros(leads + steps + 1, dtype=torch.float64, device=ctx.device)
        if self.server is not None:
            for a in self.server.report.applications:
                stats[2 * w + a.staleness] += 1
                stats[leads + a.lead] += 1
            stats[-1] = self.server.report.updates
        else:
            stats[ctx.rank] = self.worker.report.pushes_per_s
            stats[w + ctx.rank] = self.last_loss
        ctx.comm.all_reduce(stats, ctx.group("world"))
        stats = stats.cpu()
        histogram = {str(k): int(c) for k, c in enumerate(stats[2 * w : leads].tolist()) if c}
        max_lead = max((k for k, c in enumerate(stats[leads:-1].tolist()) if c), default=0)
        ps = self.setup
        return {
            "final_loss": stats[w : 2 * w].mean().item(),
            "ps": {
                "mode": ps.mode, "servers": ps.roles.servers, "workers": w, "staleness_bound": ps.staleness,
                "slow_worker": self.slow_worker,
                "pushes_per_s": stats[:w].tolist(),
                "updates_applied": int(stats[-1].item()), "staleness_histogram": histogram,
                "max_staleness": max((int(k) for k in histogram), default=0), "max_clock_lead": max_lead,
            },
        }

    def worker_figures(self) -> dict[str, float]:
        """This worker's pushes/s and the version it pulled last (for the step's metrics record)."""
        if self.worker is None or not self.worker.report.versions:
            return {}
        return {"pushes_per_s": self.worker.report.pushes_per_s, "version": self.worker.report.versions[-1]}

