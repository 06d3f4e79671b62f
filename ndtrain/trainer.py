"""The training loop: data order, LR schedule, evaluation, checkpoints, metrics and progress.

Data: the corpus is cut into samples (x, y, positions: data/corpus.py), stacked field by field into
batches; each epoch is a seeded permutation and
global step s trains on its windows [s·G, (s+1)·G) (G = global batch), dealt round-robin to the dp
ranks, so the data order is a pure function of (seed, epoch, step) and resuming needs only the
step (counted from `data_start`, which is 0 unless a resume changed the data: run/data_identity.py). Each rank splits its G/dp windows into micro-batches (gradient accumulation).
Evaluation: a fixed, evenly spaced subset of validation windows, split into uneven contiguous
shards (no padding), loss and token counts summed with one all-reduce; a language model's records
add val_ppl (exp of the mean loss per target token) and val_accuracy (next-token accuracy:
eval/token_metrics.py).
The data sets, the model and any evaluation beyond the loss come from the config's `Task`
(run/tasks.py): the byte-level language model above by default, e.g. digits retrieval by preset.
Timing: summary.json's step_time_median_s is the median over every step of this invocation after its
first `STEADY_AFTER` (rank 0's clock, training only); the metrics records time the logged steps.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn


from ndtrain.checkpoint.store import checkpoint_name, load_checkpoint, select_checkpoint
from ndtrain.config import TrainConfig, dump_toml
from ndtrain.console import console_stream, ensure_console, log
from ndtrain.data.identity import read_fingerprint
from ndtrain.data.prepare import cache_folder
from ndtrain.data.sampler import DistributedSampler, eval_shard
from ndtrain.engine import Batch, StepResult
from ndtrain.run.engine_kinds import TrainingEngine, engine_kind
from ndtrain.errors import UserError
from ndtrain.dist.memory import peak_bytes, release_freed_host_memory, reset_peak
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.run.metrics import MetricsLog, format_table, human_bytes, plot_loss_curve
from ndtrain.checkpoint.run_model import build_run_model, with_lora
from ndtrain.models.build import model_label
from ndtrain.run.data_identity import data_start_after_resume
from ndtrain.run.directory import nothing_to_resume
from ndtrain.run.preemption import Preempted, StopRequest
from ndtrain.run.optimizers import describe as describe_optimizer, lr_lambda, optimizer_factory
from ndtrain.run.progress import Progress
from ndtrain.run.info import environment, utc_now
from ndtrain.run.timeline import TimelineRecorder
from ndtrain.run.tasks import build_task
from ndtrain.run.trackers import Trackers, flat_config
from ndtrain.parallel.data.sync_batchnorm import describe_batchnorm

STEADY_AFTER = 1  # summary's step_time_median_s skips an invocation's first step: it builds buffers, thread pools, caches

def wrap_parts(head: str, parts: list[str], width: int = 160) -> list[str]:
    """`parts` joined by "; " into lines of at most `width` characters where they fit (a part longer than
    that, e.g. a long path, gets a line of its own), the first line starting with `head`, the others
    indented under it: the console's lines stay short whatever the data's description holds."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += f"; {part}"
        else:
            lines.append((head if not lines else "ndtrain:".ljust(len(head))) + part)
    return lines


def stack(items: list[tuple[torch.Tensor, ...]]) -> Batch:
    """Samples of equal arity stacked field by field: a language model's (x, y, positions) → [B, T] each,
    the digits task's (image, label) → [B, ...] each."""
    return tuple(torch.stack(field) for field in zip(*items))


def elastic_restarts() -> int:
    """How often torchrun's agent has restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


ModelFn = Callable[[], nn.Module]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def seeded(model_fn: ModelFn, seed: int) -> ModelFn:
    """`model_fn` called under `torch.manual_seed(seed)` (caller's RNG untouched): the same weights on every rank."""
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return model_fn()
    return build


def build_engine(cfg: TrainConfig, ctx: ParallelContext, model_fn: ModelFn | None = None,
                 loss_fn: LossFn | None = None) -> TrainingEngine:
    """`optim.name`'s torch optimizer (weight decay on matrices only: the engine's default parameter groups) at
    the peak learning rate `optim.scaled_lr` (`optim.lr`, scaled to the global batch by `optim.lr_scaling`),
    warmup + `schedule.lr_scheduler` (run/optimizers.py), in the engine kind of the config
    (run/engine_kinds.py: `Engine`, or `PSEngine` when ps.servers > 0).
    The model: `model_fn`'s (seeded), else the config's (built-in preset or hf:PATH, model.init_from), with
    the config's LoRA adapters."""
    return engine_kind(cfg, ctx).build(
        (lambda: with_lora(seeded(model_fn, cfg.seed)(), cfg.lora, cfg.seed)) if model_fn is not None
        else lambda: build_run_model(cfg.model, cfg.seed, cfg.lora),
        optimizer_factory(cfg), lr_lambda(cfg), loss_fn,
    )


class Trainer:
    """`Trainer(cfg)` trains the config's model; `Trainer(cfg, model_fn=..., loss_fn=...)` a user's
    `nn.Module` (`loss_fn(model(tokens), targets)`; without it `model(tokens, targets)` is the loss),
    with the same data, eval, schedule, metrics, checkpoints and resume. `ctx`: `ndtrain.init(cfg.parallel)`
    when not given."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext | None = None, *, model_fn: ModelFn | None = None,
                 loss_fn: LossFn | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx if ctx is not None else init(cfg.parallel)
        self.model_fn, self.loss_fn = model_fn, loss_fn
        self.tokens_total = 0  # tokens trained on since step 0 (kept in checkpoints)
        self.run_dir = Path(cfg.log.out)
        self.checkpoints = self.run_dir / "checkpoints"
        with self.ctx.phases.startup("preparing the data"):
            self.task = build_task(cfg)
        self.data_fingerprint = read_fingerprint(cache_folder(cfg.data, self.run_dir))  # None: no token file
        self.data_start = 0  # the step the data order counts from (data.allow_change moves it)
        self.kind = engine_kind(cfg, self.ctx)
        self.corpus_description = self.task.data_description
        self.train_set, self.val_set = self.task.train_set, self.task.val_set
        dp, dp_rank = self.data_ranks()
        self.accumulation = cfg.schedule.accumulation_steps(dp)
        self.rank_batch = cfg.schedule.global_batch // dp
        self.sampler = DistributedSampler(len(self.train_set), dp, dp_rank, seed=cfg.seed)
        self.steps_per_epoch = len(self.sampler) // self.rank_batch
        self._epoch_cache: tuple[int, list[int]] = (-1, [])
        if self.steps_per_epoch == 0:
            raise UserError(
                f"the training data has {len(self.train_set)} items ({self.task.items}), fewer than "
                f"one global batch of {cfg.schedule.global_batch}: use more data or a smaller schedule.global_batch"
            )
        self.timeline = TimelineRecorder(cfg, self.ctx, self.run_dir)
        with self.ctx.phases.startup("building the model"):
            self.engine = self.make_engine()
            release_freed_host_memory()  # what building the whole model left behind on the C heap
        self.trackers = Trackers(cfg.log.report_to if self.ctx.is_main else [], self.run_dir)

    def data_ranks(self) -> tuple[int, int]:
        """How many ranks share the data and this rank's place among them: the dp axis (a parameter
        server's workers)."""
        return self.kind.data_ranks()

    def make_engine(self) -> TrainingEngine:
        return build_engine(self.cfg, self.ctx, self.model_fn if self.model_fn is not None else self.task.model_fn,
                            self.loss_fn)

    # ---- data -------------------------------------------------------------------------------
    def _epoch_indices(self, epoch: int) -> list[int]:
        if self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, self.sampler.epoch_indices(epoch))
        return self._epoch_cache[1]

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches for global step `step` (0-based)."""
        epoch, position = divmod(step - self.data_start, self.steps_per_epoch)
        indices = self._epoch_indices(epoch)[position * self.rank_batch : (position + 1) * self.rank_batch]
        batch = self._fit(stack([self.train_set[i] for i in indices]))
        if self.ctx.device.type == "cuda":  # page-locked: the engine's non-blocking copies overlap compute
            batch = tuple(t.pin_memory() for t in batch)
        size = self.cfg.schedule.micro_batch
        return [tuple(t[i : i + size] for t in batch) for i in range(0, len(indices), size)]

    @cached_property
    def eval_indices(self) -> list[int]:
        """Evenly spaced validation windows (all when data.eval_samples is 0), this rank's shard."""
        total = len(self.val_set)
        wanted = total if self.cfg.data.eval_samples == 0 else min(total, self.cfg.data.eval_samples)
        chosen = [i * total // wanted for i in range(wanted)]
        shard = eval_shard(len(chosen), *self.data_ranks())
        return [chosen[i] for i in shard]

    def eval_batches(self) -> Iterator[Batch]:
        size = self.cfg.schedule.micro_batch
        for start in range(0, len(self.eval_indices), size):
            yield self._fit(stack([self.val_set[i] for i in self.eval_indices[start : start + size]]))

    def _fit(self, batch: Batch) -> Batch:
        """(tokens, targets) without the positions of packed documents when the model cannot take them
        (a model of your own with a `loss_fn`): its documents then attend to each other, as the run's
        description says."""
        return batch if self.engine.takes_positions else batch[:2]

    # ---- loop -------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest verified checkpoint of the run directory; return the step to continue from.

        `checkpoint.overwrite` starts over instead: the old checkpoints and metrics are deleted
        first. It applies to the run's first start only, not when torchrun's elastic agent
        restarts the workers (TORCHELASTIC_RESTART_COUNT > 0), which must resume.

        A checkpoint of other data (its recorded fingerprint, run/data_identity.py) is refused unless
        `data.allow_change`, which restarts the data order at the resumed step; a checkpoint saved before
        fingerprints were recorded has none and is resumed on any data, unchecked.
        """
        start_over = self.cfg.checkpoint.overwrite and elastic_restarts() == 0
        if start_over and self.ctx.is_main:
            for name in ("metrics.jsonl", "summary.json", "loss.png", "timeline.json"):
                (self.run_dir / name).unlink(missing_ok=True)
        if not self.kind.checkpoints:
            return 0
        with self.ctx.phases.load("the newest verified checkpoint", self.engine.parameter_count):
            path = select_checkpoint(self.checkpoints, self.ctx, start_over)  # rank 0 hashes while the others wait
        if path is None:
            if self.cfg.checkpoint.resume:
                raise nothing_to_resume(self.checkpoints)
            return 0
        with self.ctx.phases.load(path.name, self.engine.parameter_count):
            progress = load_checkpoint(path, self.engine)  # any layout: the data position is in global batches
        saved_batch = progress.get("global_batch", self.cfg.schedule.global_batch)
        if saved_batch != self.cfg.schedule.global_batch:
            raise UserError(f"checkpoint {str(path)!r} was trained with schedule.global_batch = {saved_batch}, this run "
                            f"has {self.cfg.schedule.global_batch}: resume with the same global batch (any layout)")
        saved_optimizer = progress.get("optimizer", "adamw")  # written before optim.name existed: AdamW's
        if saved_optimizer != self.cfg.optim.name:
            raise UserError(f"checkpoint {str(path)!r} holds the state of optim.name = {saved_optimizer}, this run "
                            f"uses {self.cfg.optim.name}: resume with the same optimizer, or use a fresh --out directory")
        self.tokens_total = int(progress.get("tokens", 0))
        step = int(progress["step"])
        self.data_start, warning = data_start_after_resume(progress, path, step, self.data_fingerprint,
                                                           self.cfg.data.allow_change)
        if warning is not None and self.ctx.is_main:
            log.warning(f"ndtrain: warning: {warning}")
        return step

    def save(self, step: int) -> None:
        self.engine.save(self.checkpoints, step=step, keep=self.cfg.checkpoint.keep,
                         progress={"tokens": self.tokens_total, "unit": self.task.unit,
                                   "global_batch": self.cfg.schedule.global_batch, "optimizer": self.cfg.optim.name,
                                   "data": self.data_fingerprint, "data_start": self.data_start})

    def run(self) -> dict[str, Any]:
        """Train to `schedule.steps`; on SIGTERM/SIGINT stop after the current step with a checkpoint (Preempted)."""
        with self.kind.stop_request() as stop_request, self.trackers:
            return self.train(stop_request)

    def train(self, stop_request: StopRequest) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        restarts = elastic_restarts()
        main = ctx.is_main
        ensure_console(main)
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        with ctx.phases.startup("the first barrier"):
            ctx.comm.barrier(ctx.group("world"))
        start = self.resume()
        if start >= cfg.schedule.steps and restarts:  # the agent restarted us after the last checkpoint
            if main:
                log.info(f"ndtrain: the run was complete at step {start} before elastic restart {restarts}")
            return {"steps": start, "resumed_from": start, "restarts": restarts}
        if start >= cfg.schedule.steps:
            raise UserError(
                f"the run in {str(self.run_dir)!r} is already complete at step {start}: "
                f"use a new --out directory, or --steps N > {start} to continue it"
            )
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep_until_step=start,
                             steps_per_epoch=self.steps_per_epoch, sinks=[self.trackers.log]) if main else None
        if main:
            (self.run_dir / "config.toml").write_text(dump_toml(cfg))
            log.info(self.describe(start, restarts))
            self.trackers.start(flat_config(cfg), start)
        progress = Progress(cfg.log.progress, cfg.log.every, cfg.schedule.steps, start, main, console_stream(),
                            unit=self.task.unit)
        started = time.perf_counter()
        tokens_seen, step_peak, result, task_metrics = 0, 0, None, {}
        step_times: list[float] = []  # this invocation's, every step (the records hold every log.every-th)
        val_fields: dict[str, float] = {"val_loss": float("nan")}  # the last evaluation's (token_metrics.py)
        stop = cfg.schedule.steps
        if cfg.checkpoint.exit_after:
            stop = min(stop, start + cfg.checkpoint.exit_after)
        for step in range(start, stop):
            reset_peak(ctx.device)
            self.timeline.before(step + 1, self.engine)
            t0 = time.perf_counter()
            result = self.engine.train_step(self.micro_batches(step) if self.kind.reads_data() else [])
            elapsed = time.perf_counter() - t0
            step_times.append(elapsed)
            self.timeline.after(step + 1, self.engine)
            rank_peak = peak_bytes(ctx.device)
            step_peak = max(step_peak, rank_peak)
            tokens_seen += result.tokens
            self.tokens_total += result.tokens
            done = step + 1
            record: dict[str, Any] = {}
            if done % cfg.log.every == 0 or done == cfg.schedule.steps:
                record.update(self.step_record(done, result, elapsed, rank_peak))
            evaluate_now = (cfg.log.eval_every and self.kind.lockstep and done % cfg.log.eval_every == 0) \
                or done == cfg.schedule.steps
            if evaluate_now:
                with ctx.phases.evaluation(done, len(self.eval_indices), elapsed / self.rank_batch):
                    val_fields = self.engine.evaluate(self.eval_batches()).record()
                    task_metrics = self.task.evaluate(self.engine) if self.task.evaluate else {}
                    if done == cfg.schedule.steps and self.task.test:
                        task_metrics.update(self.task.test(self.engine))
                record.update(step=done, **val_fields, **task_metrics)
            stop_signal = stop_request.agreed(ctx.comm, ctx.group("world"), ctx.device) if self.kind.checkpoints else 0
            save_now = (cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0) or done == stop or stop_signal
            if save_now and self.kind.checkpoints:
                self.save(done)
            if metrics and record:
                metrics.write(record)
            progress.update(done, loss=result.loss, tokens=result.tokens,
                            val=val_fields["val_loss"] if evaluate_now else None,
                            lr=result.lr, grad_norm=result.grad_norm, mem_bytes=rank_peak)
            if stop_signal and done < stop:
                progress.close()
                raise Preempted(stop_signal, done, checkpoint_name(done))
        progress.close()
        wall = time.perf_counter() - started
        peak = torch.tensor(float(step_peak), device=ctx.device)
        ctx.comm.all_reduce(peak, ctx.group("world"), op=torch.distributed.ReduceOp.MAX)
        summary = {
            "steps": stop, "resumed_from": start, "final_loss": result.loss, **val_fields,
            "tokens": tokens_seen, "seconds": wall, "tokens_per_s": tokens_seen / wall,
            "comm_bytes_per_step": result.comm_bytes, "peak_memory_bytes_max_rank": int(peak.item()),
            "world_size": ctx.world_size, "parameters": self.engine.parameter_count,
            "model_state_bytes_rank0": self.engine.model_state_bytes(),
            "skipped_steps": self.engine.skipped_steps, "peak_lr": cfg.optim.scaled_lr(cfg.schedule.global_batch),
            "restarts": restarts, "unit": self.task.unit, "loss_unit": self.task.loss_unit, **task_metrics,
            "step_time_median_s": statistics.median(step_times[STEADY_AFTER:]) if step_times[STEADY_AFTER:] else None,
        }
        summary.update(self.kind.summary(self.engine))
        if main:
            summary.update(started=metrics.clock.started, finished=utc_now(), elapsed_s=metrics.clock.elapsed_s(),
                           epoch=stop / self.steps_per_epoch, **environment())
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            self.trackers.finish(summary)
            plot_loss_curve(metrics.read(), self.run_dir / "loss.png", f"{cfg.model.preset} on {ctx.world_size} ranks",
                            self.task.loss_unit, self.task.outputs)
            log.info(self.summary_table(summary))
        return summary

    def step_record(self, step: int, result: StepResult, elapsed: float, peak: int) -> dict[str, Any]:
        return {
            "step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens_per_s": result.tokens / elapsed, "step_time_s": elapsed,
            "comm_bytes_per_step": result.comm_bytes, "peak_memory_bytes": peak,
            "skipped": result.skipped, "loss_scale": result.loss_scale, **self.kind.step_record(self.engine),
        }

    def describe(self, start: int, restarts: int = 0) -> str:
        cfg, ctx = self.cfg, self.ctx
        layout = self.kind.layout()
        action = f"resuming at step {start}" if start else "starting"
        batchnorm = describe_batchnorm(self.engine.model, self.data_ranks()[0], cfg.schedule.micro_batch)
        if restarts:
            action += f" after elastic restart {restarts}"
        return "\n".join([
            f"ndtrain: {action}: model {self.model_label} ({self.engine.parameter_count / 1e6:.2f} M params), "
            f"{layout} on {ctx.world_size} {ctx.device.type} process(es), backend {ctx.backend}, "
            f"{torch.get_num_threads()} thread(s)/process",
            *wrap_parts("ndtrain: data ", self.corpus_description.split("; ")),
            f"ndtrain: {len(self.train_set)} train / {len(self.val_set)} val {self.task.items}; global batch "
            f"{cfg.schedule.global_batch} = {self.kind.data_split()} × micro {cfg.schedule.micro_batch} × accumulation "
            f"{self.accumulation}",
            f"ndtrain: {cfg.optim.describe_lr(cfg.schedule.global_batch)}",
            f"ndtrain: {describe_optimizer(cfg)}",
            *([f"ndtrain: LoRA r={cfg.lora.r}, alpha={cfg.lora.alpha:g} on {', '.join(cfg.lora.targets)}: "
               f"{self.engine.trainable_count:,} trainable of {self.engine.parameter_count:,} parameters, the rest "
               "frozen"] if cfg.lora.r else []),
            *([f"ndtrain: {batchnorm}"] if batchnorm else []),
            *(["ndtrain: packed documents attend to each other: the model takes no positions (a model with a "
               "`parallel_spec` or a Hugging Face one keeps them apart; or set data.packing=false)"]
              if not self.engine.takes_positions and len(self.train_set[0]) > 2 else []),
            f"ndtrain: run dir {self.run_dir}",
        ])

    @property
    def model_label(self) -> str:
        return model_label(self.cfg.model) if self.model_fn is None else type(self.engine.model).__name__

    def summary_table(self, s: dict[str, Any]) -> str:
        rows = [
            ("steps", f"{s['steps']} (resumed from {s['resumed_from']})" if s["resumed_from"] else str(s["steps"])),
            ("model", self.model_label),
            ("final train loss", f"{s['final_loss']:.4f} {self.task.loss_unit}"),
            ("validation loss", f"{s['val_loss']:.4f} {self.task.loss_unit}"),
            *((("validation perplexity", f"{s['val_ppl']:.4g}"), ("next-token accuracy", f"{s['val_accuracy']:.2%}"))
              if "val_accuracy" in s else ()),
            *((name, f"{s[name]:.4f}") for name in self.task.metrics if name in s),
            (self.task.unit, f"{s['tokens']:,}"),
            ("wall time", f"{s['seconds']:.1f} s"),
            ("throughput", f"{s['tokens_per_s']:,.0f} {self.task.unit}/s"),
            ("comm per step", f"{human_bytes(s['comm_bytes_per_step'])} sent per rank"),
            ("model state, rank 0", ", ".join(f"{k} {human_bytes(v)}" for k, v in s["model_state_bytes_rank0"].items())),
            ("peak memory", f"{human_bytes(s['peak_memory_bytes_max_rank'])} (max over ranks)"),
            ("skipped steps", f"{s['skipped_steps']} (inf/NaN gradients or loss)"),
            ("elastic restarts", str(s["restarts"])),
            *self.kind.summary_rows(s),
            ("run directory", str(self.run_dir)),
        ]
        return format_table(rows, self.kind.title)
