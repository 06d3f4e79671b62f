"""The training loop of parameter-server mode (`ps.servers` > 0), on top of the `Trainer`'s data.

Workers (ranks 0..W−1) take the Trainer's data order with W data ranks: worker w's step s trains
on its share of global step s's windows, so after `schedule.steps` steps of every worker the run
has seen steps × global_batch sequences whatever the mode. Servers (the last S ranks) run
`ParameterServer.serve()` until every push is applied. Workers keep no optimizer.

Reported: per logged step (worker 0) its local train loss, step time and pushes/s; at the end
one evaluation of the final parameters (every worker evaluates its shard of the validation
windows; loss and tokens summed with one world all-reduce in which servers add zeros), and a
summary with pushes/s per worker, the staleness histogram (one entry per gradient applied by a
server, summed over servers: how many updates that server applied between the worker's pull and
this gradient) and the largest clock lead (ssp's bounded quantity), gathered by one world
all-reduce of 2W + (W + 1)·steps + 1 numbers.
Evaluation happens only at the end (async workers are at different steps mid-run), and there
are no checkpoints in this mode.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from ndtrain.config import TrainConfig, dump_toml
from ndtrain.console import console_stream, ensure_console, log
from ndtrain.errors import UserError
from ndtrain.metrics import MetricsLog, format_table, human_bytes, plot_loss_curve
from ndtrain.mesh import ParallelContext
from ndtrain.models.build import build_run_model
from ndtrain.models.llama import count_parameters
from ndtrain.parallel.parameter_server import ParameterServer, PSSetup, PSWorker, ServerReport
from ndtrain.progress import Progress
from ndtrain.run_info import environment, utc_now
from ndtrain.trackers import flat_config
from ndtrain.trainer import Trainer, lr_multiplier


def check_ps_config(cfg: TrainConfig, world_size: int) -> int:
    """Refuse what parameter-server mode does not combine with; return the number of workers."""
    cfg.ps.check_world(world_size)
    unsupported = {
        "parallel.zero": cfg.parallel.zero != 0,
        "parallel.dp_mode=single-process": cfg.parallel.dp_mode != "ddp",
        "checkpoint.resume (--resume)": cfg.checkpoint.resume,
        "checkpoint.save_every": cfg.checkpoint.save_every != 0,
        "checkpoint.exit_after": cfg.checkpoint.exit_after != 0,
    }
    for option, requested in unsupported.items():
        if requested:
            raise UserError(f"{option} does not combine with parameter-server training (ps.servers > 0): leave it at its default")
    return world_size - cfg.ps.servers


class PSTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, ctx: ParallelContext) -> None:
        self.workers = check_ps_config(cfg, ctx.world_size)
        super().__init__(cfg, ctx)
        self.model = build_run_model(cfg.model, cfg.seed).to(ctx.device)
        self.setup = PSSetup.build(self.model, ctx, cfg.ps, cfg.schedule.steps)
        self.is_server = self.setup.roles.is_server(ctx.rank)
        o, s = cfg.optim, cfg.schedule
        if self.is_server:
            self.server = ParameterServer(
                self.model, ctx, self.setup,
                lambda groups: torch.optim.AdamW(
                    groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
                ),
                lr_lambda=lambda k: lr_multiplier(k, s.warmup_steps, s.steps, s.min_lr_ratio),
                grad_clip=o.grad_clip,
            )
        else:
            self.worker = PSWorker(self.model, ctx, self.setup)

    def data_ranks(self) -> tuple[int, int]:
        """W workers share the data; servers read none (they get place 0 to build the same sampler)."""
        return self.workers, self.ctx.rank if self.ctx.rank < self.workers else 0

    def make_engine(self) -> None:
        return None

    def run(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        steps, main = cfg.schedule.steps, ctx.is_main
        ensure_console(main)
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(dump_toml(cfg))
            log.info(self.describe(0))
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep_until_step=0, steps_per_epoch=self.steps_per_epoch,
                             sinks=[self.trackers.log]) if main else None
        self.trackers.start(flat_config(cfg), 0)  # no-op but on rank 0 with log.report_to
        ctx.comm.barrier(ctx.group("world"))
        started = time.perf_counter()
        report, loss = ServerReport(), float("nan")
        if self.is_server:
            report = self.server.serve()
        else:
            progress = Progress(cfg.log.progress, cfg.log.every, steps, 0, main, console_stream())
            for step in range(steps):
                t0 = time.perf_counter()
                loss = self.worker.train_step(self.micro_batches(step))
                done = step + 1
                if metrics and (done % cfg.log.every == 0 or done == steps):
                    metrics.write({
                        "step": done, "loss": loss, "step_time_s": time.perf_counter() - t0,
                        "pushes_per_s": self.worker.report.pushes_per_s, "version": self.worker.report.versions[-1],
                    })
                progress.update(done, loss=loss)
            progress.close()
        wall = time.perf_counter() - started
        val_loss = self.evaluate()
        summary = self.summarise(report, loss, val_loss, wall)
        if main:
            metrics.write({"step": steps, "val_loss": val_loss})
            summary.update(started=metrics.clock.started, finished=utc_now(), elapsed_s=metrics.clock.elapsed_s(),
                           epoch=steps / self.steps_per_epoch, **environment())
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            self.trackers.finish(summary)
            plot_loss_curve(metrics.read(), self.run_dir / "loss.png",
                            f"{cfg.model.preset}, ps {cfg.ps.mode}, {self.workers} workers + {cfg.ps.servers} servers")
            log.info(self.ps_table(summary))
        return summary

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss of the final parameters, each window counted once."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        if not self.is_server:
            self.model.eval()
            for x, y in self.eval_batches():
                loss = self.model(x.to(self.ctx.device), y.to(self.ctx.device))
                totals[0] += loss.double() * y.numel()
                totals[1] += y.numel()
        self.ctx.comm.all_reduce(totals, self.ctx.group("world"))
        return totals[0].item() / totals[1].item() if totals[1].item() else float("nan")

    def summarise(self, report: ServerReport, loss: float, val_loss: float, wall: float) -> dict[str, Any]:
        cfg, ctx, w, steps = self.cfg, self.ctx, self.workers, self.cfg.schedule.steps
        leads = 2 * w + w * steps  # the histograms: staleness < W·steps, clock lead < steps
        stats = torch.zeros(leads + steps + 1, dtype=torch.float64)
        if self.is_server:
            for a in report.applications:
                stats[2 * w + a.staleness] += 1
                stats[leads + a.lead] += 1
            stats[-1] = report.updates
        else:
            stats[ctx.rank] = self.worker.report.pushes_per_s
            stats[w + ctx.rank] = loss
        ctx.comm.all_reduce(stats, ctx.group("world"))
        histogram = {str(k): int(c) for k, c in enumerate(stats[2 * w : leads].tolist()) if c}
        max_lead = max((k for k, c in enumerate(stats[leads:-1].tolist()) if c), default=0)
        tokens = steps * cfg.schedule.global_batch * cfg.model.seq_len
        comm = ctx.comm.stats.total_wire_bytes() / steps if not self.is_server else 0
        return {
            "steps": steps, "final_loss": stats[w : 2 * w].mean().item(), "val_loss": val_loss,
            "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "comm_bytes_per_step": comm, "world_size": ctx.world_size, "parameters": count_parameters(self.model),
            "ps": {
                "mode": cfg.ps.mode, "servers": cfg.ps.servers, "workers": w, "staleness_bound": cfg.ps.staleness,
                "slow_worker": cfg.ps.slow_worker, "pushes_per_s": stats[:w].tolist(),
                "updates_applied": int(stats[-1].item()), "staleness_histogram": histogram,
                "max_staleness": max((int(k) for k in histogram), default=0), "max_clock_lead": max_lead,
            },
        }

    def describe(self, start: int) -> str:
        cfg, ctx = self.cfg, self.ctx
        bound = f" (staleness ≤ {cfg.ps.staleness})" if cfg.ps.mode == "ssp" else ""
        return (
            f"ndtrain: starting: model {cfg.model.preset} ({count_parameters(self.model) / 1e6:.2f} M params), "
            f"parameter server {cfg.ps.mode}{bound}: {self.workers} worker(s) (ranks 0..{self.workers - 1}) + "
            f"{cfg.ps.servers} server(s) on {ctx.world_size} {ctx.device.type} process(es), backend {ctx.backend}\n"
            f"ndtrain: data {self.corpus_description}: {len(self.train_set)} train / {len(self.val_set)} val windows "
            f"of {cfg.model.seq_len} tokens; global batch {cfg.schedule.global_batch} = {self.workers} workers × "
            f"micro {cfg.schedule.micro_batch} × accumulation {self.accumulation}; run dir {self.run_dir}"
        )

    def ps_table(self, s: dict[str, Any]) -> str:
        ps = s["ps"]
        rows = [
            ("steps per worker", str(s["steps"])),
            ("final train loss", f"{s['final_loss']:.4f} nats/byte (mean of the workers' last steps)"),
            ("validation loss", f"{s['val_loss']:.4f} nats/byte"),
            ("wall time", f"{s['seconds']:.1f} s"),
            ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
            ("pushes/s per worker", ", ".join(f"{p:.2f}" for p in ps["pushes_per_s"])),
            ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in ps["staleness_histogram"].items())
             + " (updates between a gradient's pull and its application: count)"),
            ("max clock lead", f"{ps['max_clock_lead']} step(s) ahead of the slowest worker"),
            ("comm per step", f"{human_bytes(s['comm_bytes_per_step'])} sent per worker"),
            ("run directory", str(self.run_dir)),
        ]
        return format_table(rows, "ndtrain: summary (parameter server)")
