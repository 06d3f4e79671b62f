"""`Engine`: one model + optimizer trained under a `ParallelContext`.

The engine places the model on the context's device, applies model parallelism (compose.py: tp →
recompute → cp → pipeline cut) and hands the result to exactly one data-parallel strategy over
dp×cp, chosen by `parallel.dp_mode` and `parallel.zero` from the registry of parallel/data/strategy.py, which
it drives only through the `DataParallelStrategy` interface (it never asks which one it holds):

| zero | wrapper (gradients)                              | optimizer                                   |
|------|--------------------------------------------------|---------------------------------------------|
| 0    | `DistributedDataParallel`: all-reduced, replicated           | the caller's, over the whole model          |
| 1    | `DistributedDataParallel`                                    | `ZeroOptimizer`: state sharded, all-gather  |
| 2    | `Zero2DataParallel`: reduce-scattered, sharded    | `ZeroOptimizer`                             |
| 3    | `FullyShardedDataParallel`: parameters sharded too | the caller's, over FSDP's fp32 shards       |

With `parallel.precision` bf16/fp16 the model computes in that dtype and the optimizer updates fp32
masters: stages 0–2 cast the module and hand the fp32 initial weights to `ZeroOptimizer` (which
for stage 0 keeps the whole master, `sharded=False`); stage 3 gives FSDP `param_dtype`. fp16 adds
the `LossScaler` (precision.py): a step with inf/NaN gradients is skipped (`StepResult.skipped`).
The global gradient norm and its clipping are grad_norm.py's, over the strategy's `grad_pieces()`.
In fp32/bf16 the non-finite guard reads the step's loss and global gradient norm (both already
reduced, so identical on every rank) before the optimizer step: a NaN/inf in either raises
`NonFiniteError` on every rank with nothing updated, or, with `skip_nonfinite`, skips the step
the way fp16 does. It costs no extra communication (the loss all-reduce moves before the step).

One `train_step` runs forward/backward of each micro-batch (stages 0/1: gradient sync only on the
last, via `no_sync`; stages 2/3 reduce-scatter every micro-batch into the shard, keeping memory
sharded), the loss-scale check, the global gradient norm and clipping, the optimizer and LR
schedule steps. Per step, Ψ fp32 parameters, N = dp×cp, k micro-batches, each rank sends:
stage 0 2(N−1)/N·4Ψ; stage 1 + (N−1)/N·4Ψ (all-gather); stage 2 k·(N−1)/N·4Ψ + (N−1)/N·4Ψ;
stage 3 see zero3_parameters.py; `parallel.sync_batchnorm` an all-gather and an all-reduce per BatchNorm layer
and micro-batch (parallel/data/sync_batchnorm.py), `parallel.broadcast_buffers` one broadcast of the
buffers per step (parallel/data/buffers.py); plus a 4-byte all-reduce of the norm's squares (over dp_cp for
stages 1–3, over mp under model parallelism, over the world for both), a 4-byte flag
(fp16), one 8-byte all-reduce of the step's target count before the first forward (the weights that
make the loss the mean over the global batch's targets, parallel/target_mean.py) and one 16-byte
all-reduce of the loss and token count for reporting.

Host synchronisation (what a CUDA step waits for on the host): one device→host read per step, of
the reduced loss, token count, gradient norm and fp16's overflow flag together, after the
backward and before the optimizer step (the non-finite guard and the loss scaler decide on the
host whether to step). Clipping, unscaling and the overflow check stay on the device. A pipeline
adds the receive of one 10-element shape header per stage boundary and step (pipeline/runner.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ndtrain.checkpoint.buffers import buffer_names
from ndtrain.checkpoint.store import load_checkpoint, save_checkpoint, select_checkpoint
from ndtrain.checkpoint.manifest import MANIFEST, verify
from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.eval.token_metrics import Evaluation, Tally, scoring
from ndtrain.dist.memory import peak_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.hf_parallel import spec_of, takes_positions
from ndtrain.parallel.model_spec import bind_spec
from ndtrain.parallel.counting import count_parameters
from ndtrain.parallel.compose import ModelParallelState, prepare_model
from ndtrain.parallel.placement import name_parameters
from ndtrain.parallel.model.context import shard_sequence
from ndtrain.parallel.data.strategy import STRATEGIES, ShardedModel, Strategies, build_data_parallel
from ndtrain.parallel.grad_norm import clip_, global_grad_norm
from ndtrain.parallel.pipeline import Timeline, eval_pipeline, run_pipeline
from ndtrain.parallel.precision import DTYPES, LossScaler
from ndtrain.parallel.target_mean import step_weights, target_count
from ndtrain.parallel.data.param_groups import GroupFn, no_decay_for_vectors
from ndtrain.parallel.data.buffers import BufferBroadcast
from ndtrain.parallel.data.sync_batchnorm import synchronise_batchnorm

Batch = tuple[torch.Tensor, ...]  # (tokens, targets[, positions]), each [B, T] int64; targets −100: not a target


@dataclass
class StepResult:
    loss: float          # mean loss over the global batch's targets (parallel/target_mean.py)
    tokens: int          # tokens in the global batch
    grad_norm: float     # global gradient norm before clipping (inf/nan on a skipped step)
    lr: float            # learning rate used for this step
    comm_bytes: int      # wire bytes this rank sent during the step
    skipped: bool = False    # inf/NaN gradients (fp16) or loss/norm (skip_nonfinite): no optimizer step
    loss_scale: float = 1.0  # fp16 loss scale used for this step


class NonFiniteError(UserError):
    """The loss or the global gradient norm of step `step` (1-based) is NaN or inf; nothing was updated.

    `newest_checkpoint` (set by whoever knows the run directory) names what a re-run resumes from."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        super().__init__()
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.newest_checkpoint: str | None = None

    def __str__(self) -> str:
        where = "" if self.newest_checkpoint is None else f"; the newest checkpoint is {self.newest_checkpoint}"
        return (
            f"step {self.step}: loss is {self.loss:.6g} (gradient norm {self.grad_norm:.6g}): the run stopped before the "
            f"optimizer step{where}; lower optim.lr or set optim.skip_nonfinite = true"
        )


def check_layout(parallel: ParallelConfig, ctx: ParallelContext) -> None:
    """`parallel`'s axis sizes (dp resolved against the world) must be the context's: one line otherwise."""
    sizes = {"dp": parallel.resolve_dp(ctx.world_size), "cp": parallel.cp, "pp": parallel.pp, "tp": parallel.tp}
    here = {axis: ctx.size(axis) for axis in sizes}
    if sizes != here:
        raise UserError(f"the parallel config's layout {sizes} is not the context's {here}: "
                        "give Engine the ParallelConfig the context was built from (mesh.init(config))")


class Engine:
    """Builds and drives one model replica (or shard, zero=3) of the data-parallel group."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        optimizer_fn: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        ctx: ParallelContext,
        parallel: ParallelConfig,
        *,
        group_fn: GroupFn = no_decay_for_vectors,
        scheduler_fn: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
        grad_clip: float = 0.0,
        loss_scaler: LossScaler | None = None,
        skip_nonfinite: bool = False,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        tp_plan: Mapping[str, str] | None = None,
        strategies: Strategies = STRATEGIES,
    ) -> None:
        """`optimizer_fn(groups)` builds the optimizer from parameter groups (`group_fn(name, param)`
        gives each parameter's group options); under ZeRO the groups hold this rank's shards.
        `model_fn()` builds the whole model; with tp/cp/pp/recompute it is transformed in place
        and cut to this rank's part (compose.py). `loss_scaler` overrides fp16's `LossScaler(ctx)`.
        Without a loss scaler a NaN/inf loss or gradient norm raises `NonFiniteError`, or skips the
        step when `skip_nonfinite`. `loss_fn(output, targets)` → scalar: when given the engine calls
        `model(tokens)` and applies it (pipeline: the last stage does); when None, `model(tokens,
        targets)` returns the loss (the built-in Llama, the `CausalLM` adapter). `tp_plan` (module
        pattern → style, tp_plan.py) splits the model over tp; None: the plan shipped for the model.
        `ctx` is the topology (groups, device); `parallel` the strategy options (zero, precision,
        schedules, buckets...), whose axis sizes must be the context's. `strategies`: the registry
        the data-parallel strategy is built from (parallel/data/strategy.py; default the built-in one)."""
        cfg = parallel
        check_layout(cfg, ctx)
        self.ctx = ctx
        self.parallel = cfg
        self.grad_clip = grad_clip
        self.skip_nonfinite = skip_nonfinite
        self.nonfinite_skips = 0
        self._steps = 0  # train_step calls, numbering steps when there is no LR schedule
        self.compute_dtype = DTYPES[cfg.precision]
        full = model_fn().to(ctx.device)
        full = synchronise_batchnorm(full, ctx) if cfg.sync_batchnorm else full  # same tensors and names
        name_parameters(full)
        self.buffer_sites = buffer_names(full)  # persistent buffers by their unsharded names (checkpoints)
        self.parameter_count = count_parameters(full)
        self.trainable_count = count_parameters(full, trainable=True)  # all but a LoRA run's frozen base
        full_shapes = {name: p.shape for name, p in full.named_parameters(remove_duplicate=False)}
        self.loss_fn = loss_fn
        spec = spec_of(full)  # the model's own, or a bare transformers model's family spec (models/)
        if spec is not None:
            bind_spec(full, spec)  # what the strategies' `parallel_spec(full)` answers
        self._positions = spec is not None and spec.takes_position_ids  # a cp shard's or packed documents' positions
        self.takes_positions = takes_positions(full, loss_fn)  # packed documents can be kept apart
        self.model = prepare_model(full, ctx, cfg, tp_plan=tp_plan, loss_fn=loss_fn)
        self.model_parallel = ctx.group("mp").size > 1
        self.mp_state = ModelParallelState(self.model, ctx, full_shapes, cfg.pp_virtual) if self.model_parallel else None
        self.pipeline = cfg.pp > 1
        self.timeline: Timeline | None = None  # set one to record the next steps' pipeline actions
        self.dp = build_data_parallel(self.model, ctx, cfg, optimizer_fn, group_fn, strategies)  # casts to compute_dtype
        self.wrapped: nn.Module = self.dp.module
        self.optimizer: torch.optim.Optimizer = self.dp.optimizer
        self.buffers = BufferBroadcast(self.model, ctx, cfg.broadcast_buffers, cfg.bucket_mb)
        self.scheduler = scheduler_fn(self.optimizer) if scheduler_fn else None
        self.scaler = loss_scaler or (LossScaler(ctx) if cfg.precision == "fp16" else None)
        self.dp.step_during_backward(grad_clip == 0 and self.scaler is None and not skip_nonfinite)

    # ----------------------------------------------------------------------------- training
    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (equal sizes, full-length samples)."""
        comm_before = self.ctx.comm.stats.total_wire_bytes()
        self.model.train()
        self.buffers.sync()
        self.dp.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        scale = self.scaler.scale if self.scaler else 1.0
        batches = [self._model_inputs(*batch) for batch in micro_batches]
        weights = step_weights(torch.stack([target_count(batch[1]) for batch in batches]), self.ctx)  # target_mean.py
        if self.pipeline:
            loss_sum = run_pipeline(
                self.dp.chunks, batches, self.ctx, self.parallel.pp_schedule, self.timeline, weights=weights,
                loss_scale=scale, hooks=self.dp.stage_hooks,
            )
        else:
            loss_sum = self._forward_backward(batches, weights, scale)
        tokens = sum(batch[1].numel() for batch in batches)
        overflow = self.scaler.unscale(self.dp.optimizer_grads()) if self.scaler else None  # fp16: device flag
        norm = self._clip()
        group = self.ctx.group("dp_cp")
        totals = torch.stack([loss_sum.double() / group.size, loss_sum.new_full((), float(tokens), dtype=torch.float64)])
        self.ctx.comm.all_reduce(totals, group)  # filled on the device: no copy
        # the step's one device→host read: loss, tokens, norm (and fp16's overflow flag) together
        figures = [totals, norm.double().reshape(1)] + ([overflow.double()] if overflow is not None else [])
        read = torch.cat(figures).tolist()
        loss, token_total, grad_norm = read[0], int(read[1]), read[2]
        found_inf = overflow is not None and read[3] > 0
        self._steps += 1
        skip = found_inf or self._nonfinite(loss, grad_norm)
        if not skip:
            self.optimizer.step()
        if self.scaler:
            self.scaler.update(found_inf)
        if self.scheduler is not None:
            self.scheduler.step()
        return StepResult(
            loss=loss, tokens=token_total, grad_norm=grad_norm, lr=lr,
            comm_bytes=self.ctx.comm.stats.total_wire_bytes() - comm_before, skipped=skip, loss_scale=scale,
        )

    def _nonfinite(self, loss: float, grad_norm: float) -> bool:
        """The guard (fp32/bf16): True to skip this step; raises `NonFiniteError` unless skipping is allowed.
        Both values are reduced over the ranks, so every rank decides the same."""
        if self.scaler is not None or (math.isfinite(loss) and math.isfinite(grad_norm)):
            return False
        if not self.skip_nonfinite:
            step = self.scheduler.last_epoch if self.scheduler is not None else self._steps - 1
            raise NonFiniteError(step + 1, loss, grad_norm)
        self.nonfinite_skips += 1
        return True

    @property
    def skipped_steps(self) -> int:
        """Steps without an optimizer update: fp16 overflows plus non-finite steps skipped by the guard."""
        return (self.scaler.skipped_steps if self.scaler else 0) + self.nonfinite_skips

    def _forward_backward(self, batches: Sequence[tuple[torch.Tensor, ...]], weights: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """Σ_i w_i · loss_i over this rank's micro-batches (on the device, float64); gradients of that sum
        (× scale) accumulated: with the weights of target_mean.py, the mean over the global batch's targets."""
        count = len(batches)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i, inputs in enumerate(batches):
            with self.dp.no_sync() if i < count - 1 else contextlib.nullcontext():
                loss = self._loss(inputs)
                loss = loss * weights[i].to(loss.dtype)
                (loss * scale).backward()
            loss_sum += loss.detach().double()
            # Drop micro-batch i's autograd graph before i + 1's forward: held by `loss` until reassigned, its
            # nodes (small C-heap blocks that outlive backward) sat between i's freed activations, which glibc
            # then did not reuse for i + 1's: those came from fresh heap pages, and tp2's peak resident set
            # was ~60 MiB higher (docs/planner.md, "Measured memory check").
            del loss
        return loss_sum

    def _loss(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The wrapped model's loss on (tokens, targets[, positions]): its own, or `loss_fn` on its output."""
        if self.loss_fn is None:
            return self.wrapped(*inputs)
        # a cp shard's global positions [T/cp] (shared by the rows), or per-row positions [B, T] of packed documents
        positions = {"position_ids": inputs[2] if inputs[2].ndim == 2 else inputs[2].unsqueeze(0)} \
            if len(inputs) > 2 and self._positions else {}
        if len(inputs) > 2 and inputs[2].ndim == 2 and not positions:
            raise UserError("packed documents need a model that takes positions (position_ids=): this one would let "
                            "them attend to each other; use the built-in Llama or a Hugging Face model, or unpacked data")
        return self.loss_fn(self.wrapped(inputs[0], **positions), inputs[1])

    def _model_inputs(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """(tokens, targets[, positions]) on the device, `positions` [B, T] the per-row positions of packed
        documents; under context parallelism this rank's sequence shard and its positions: its part of
        `positions`, else its global positions [T/cp] (the cp ranks' token counts add up to the batch's)."""
        x, y = self._input(x), self._input(y)
        positions = None if positions is None else self._input(positions)
        if self.ctx.size("cp") > 1:
            return shard_sequence(x, y, self.ctx, positions)
        return (x, y) if positions is None else (x, y, positions)

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        """On the device; floating-point inputs in the compute dtype (token ids stay integers)."""
        t = t.to(self.ctx.device, non_blocking=True)  # asynchronous from pinned memory; the source lives on
        return t.to(self.compute_dtype) if t.is_floating_point() else t

    def _clip(self) -> torch.Tensor:
        """Global L2 norm of the gradient the optimizer will use, each parameter counted once over the
        whole world (grad_norm.py), on the device; clip it if `grad_clip` > 0 (torch's clip_grad_norm_
        formula, applied on the device: no host synchronisation)."""
        norm = global_grad_norm(self.dp.grad_pieces(), self.ctx, sharded=self.dp.grads_sharded)
        if self.grad_clip > 0:
            clip_(self.dp.optimizer_grads(), norm, self.grad_clip)
        return norm

    # ----------------------------------------------------------------------------- inspection
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters (compute copies; under FSDP the fp32 shards plus
        whatever unit is gathered now), gradients (buckets, comm-dtype copies, shards) and optimizer
        state (AdamW's appears after the first step; fp32 masters of mixed precision included)."""
        return self.dp.state_bytes()

    def memory_bytes(self) -> dict[str, int]:
        """`model_state_bytes()` plus "peak": this process's peak memory since the last `memory.reset_peak`."""
        return {**self.model_state_bytes(), "peak": peak_bytes(self.ctx.device)}

    @property
    def sharded_model(self) -> ShardedModel | None:
        """What gathers the whole model for `full_state_dict` (zero=3: FSDP shards; tp/pp: its slices
        and stages), else None (the model is whole on every rank)."""
        return self.dp.sharded_model if self.dp.sharded_model is not None else self.mp_state

    def extra_state(self) -> dict[str, Any]:
        """Engine state outside model and optimizer (fp16 loss scaler, guard's skips), JSON-serialisable."""
        state: dict[str, Any] = {"nonfinite_skips": self.nonfinite_skips}
        if self.scaler:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights with their original names and shapes (collective under zero=3 and tp:
        gathered); under pp only this rank's stages' parameters."""
        if self.sharded_model is not None:
            return self.sharded_model.full_state_dict()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> Evaluation:
        """Mean loss, token count and next-token accuracy over every rank's batches, each token counted
        exactly once (eval/token_metrics.py: the accuracy is measured at the model's `loss_fn` seam,
        None with the engine's own `loss_fn` or a model without that seam).

        Ranks may hold different numbers of batches (uneven evaluation shards). Under ZeRO-3 every
        forward all-gathers parameters over dp×cp, so ranks with fewer batches run padding forwards
        (the lacking count, on a one-row batch, counted zero times) to issue the same collectives;
        that costs one 16-byte all-reduce (batch count, sequence length) per evaluation. With
        `parallel.broadcast_buffers`, rank 0's buffers are broadcast first (parallel/data/buffers.py).
        The loss and the tally travel in one 32-byte all-reduce over dp×cp; under pipeline
        parallelism the tally (counted on the last stage) is first summed over pp (16 bytes)."""
        self.model.eval()
        self.buffers.sync()
        totals = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)  # Σ loss·count, count, correct, counted
        batches = list(batches)
        padding = self._eval_padding(batches)
        with scoring(self.model) if self.loss_fn is None else contextlib.nullcontext(Tally()) as tally:
            for batch, weight in [*((batch, 1) for batch in batches), *((batch, 0) for batch in padding)]:
                inputs = self._model_inputs(*batch)
                loss = eval_pipeline(self.dp.chunks, [inputs], self.ctx) if self.pipeline else self._loss(inputs)
                count = target_count(inputs[1])
                totals[0] += loss.double() * count * weight
                totals[1] += count * weight
                totals[2:] += tally.take(self.ctx.device) * weight
        if self.pipeline:
            self.ctx.comm.all_reduce(totals[2:], self.ctx.group("pp"))
        self.ctx.comm.all_reduce(totals, self.ctx.group("dp_cp"))
        loss_sum, tokens, correct, counted = totals.tolist()
        return Evaluation(loss=loss_sum / tokens if tokens else float("nan"), tokens=int(tokens),
                          accuracy=correct / counted if counted else None)

    def _eval_padding(self, batches: list[Batch]) -> list[Batch]:
        """The batches this rank forwards only to match the others' collectives (ZeRO-3's all-gathers;
        none when the strategy's forwards do not communicate)."""
        if not self.dp.forward_communicates or self.ctx.group("dp_cp").size == 1:
            return []
        shape = torch.tensor([len(batches), batches[0][0].shape[-1] if batches else 0], device=self.ctx.device)
        self.ctx.comm.all_reduce(shape, self.ctx.group("dp_cp"), op=torch.distributed.ReduceOp.MAX)
        most, seq_len = (int(v) for v in shape.tolist())
        row = torch.zeros((1, seq_len), dtype=torch.long)
        return [(row, row)] * (most - len(batches))

    # ----------------------------------------------------------------------------- checkpoints
    def save(self, path: str | Path, *, keep: int = 2, progress: dict[str, Any] | None = None,
             step: int | None = None) -> Path:
        """Write a verified checkpoint of model, optimizer, LR schedule and engine state into the
        folder `path` (as `path/step_N`, N = `step`, by default the number of `train_step` calls;
        `path/latest` names it) and keep the newest `keep` there. Collective: every rank calls it;
        each writes the slices it owns under the unsharded names (`checkpoint.save_checkpoint`).
        `progress`: more JSON to store."""
        step = self._steps if step is None else step
        state = {**(progress or {}), "step": step, "world_size": self.ctx.world_size,
                 "engine": self.extra_state(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        with self.ctx.phases.save(step, self.parameter_count):
            return save_checkpoint(Path(path), step, self, state, keep=keep)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore the newest verified checkpoint of the folder `path` (or the checkpoint `path`),
        written under any layout: model, optimizer state, LR schedule, engine state; return its
        progress. Collective. Under the layout that wrote it, continuing is bit-identical to never
        stopping; under another, equal within floating-point reassociation."""
        path = Path(path)
        checkpoint = path if (path / MANIFEST).is_file() else select_checkpoint(path, self.ctx, start_over=False)
        if checkpoint is None:
            raise UserError(f"no checkpoint in {str(path)!r}: give a folder Engine.save wrote")
        if checkpoint == path and (problem := verify(path)) is not None:
            raise UserError(f"checkpoint {str(path)!r} does not verify ({problem}): load another one")
        progress = load_checkpoint(checkpoint, self)
        self._steps = int(progress.get("step", 0))
        return progress
