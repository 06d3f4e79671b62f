"""Scenario `pp`: ndtrain's pipeline schedules against `torch.distributed.pipelining`.

Layout: every rank one pipeline stage (pp = world size, p = 2 or 4). Every contestant trains the
same Llama (same preset, seed and initial weights, cut into the same stages by parameter count)
with AdamW on the same token batches (the same on every rank: a pipeline's ranks share each
batch), m = 8 micro-batches of `--micro-batch` sequences per step, with the same loop: the
schedule's forward and backward, optimizer step, `zero_grad(set_to_none=True)`.

Contestants: ours with `gpipe`, `1f1b`, `interleaved` (v = 2), `zb` and `naive`, against torch's
`ScheduleGPipe`, `Schedule1F1B` (the reference) and `ScheduleInterleaved1F1B` (v = 2) on
`PipelineStage`s built from the very same stage modules (their last stage returns logits; the
loss is the same cross-entropy, averaged over micro-batches as ours).

Expected communication per step and rank, m micro-batches of b·T·d activations (fp32), p ranks:
each stage boundary carries m activations forward and m gradients back, so a middle rank sends
2·m·b·T·d·4 bytes (the first and last send half), ×v boundaries per rank when interleaved (plus
ours: a 10-element header per boundary and the loss broadcast; torch: its own shape metadata).

After the contest each of our schedules runs one recorded step: the facts gain its measured bubble
fraction (`bubble_<schedule>`) and the most micro-batches whose activations each rank held at once
(`live_<schedule>`: m for gpipe, p − r for 1f1b), and rank 0 writes its timeline to
bench-results/pp-n<p>-<schedule>.json (Chrome trace, opens in Perfetto) and .png.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, run_contest
from ndtrain.config import ModelConfig, config_from_dict
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.pipeline import Timeline, bubble_fraction, run_pipeline, split_model, write_chrome_trace, write_png

LR = 3e-4
MICRO_BATCHES = 8
OURS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("naive", 1))


def _tokens(options: BenchOptions) -> torch.Tensor:
    """[warmup + steps, m · micro_batch, seq_len + 1], the same stream on every rank."""
    generator = torch.Generator().manual_seed(options.seed * 1_000_003)
    shape = (options.warmup + options.steps, MICRO_BATCHES * options.micro_batch, options.seq_len + 1)
    return torch.randint(0, 256, shape, generator=generator)


def _optimizer(stages: list[nn.Module]) -> torch.optim.Optimizer:
    params = list({id(q): q for s in stages for q in s.parameters()}.values())
    return torch.optim.AdamW(params, lr=LR)


def _ours(ctx: ParallelContext, cfg: ModelConfig, options: BenchOptions, tokens: torch.Tensor,
          schedule: str, virtual: int) -> Callable[[], Step]:
    def build() -> Step:
        stages = split_model(build_model(cfg, options.seed, ctx.device), ctx, virtual=virtual)
        optimizer = _optimizer(stages)

        def step(i: int) -> None:
            batch = tokens[i].to(ctx.device)
            micro = [(x[:, :-1], x[:, 1:]) for x in batch.chunk(MICRO_BATCHES)]
            run_pipeline(stages, micro, ctx, schedule)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return build


def _torch(ctx: ParallelContext, cfg: ModelConfig, options: BenchOptions, tokens: torch.Tensor,
           schedule: str, virtual: int) -> Callable[[], Step]:
    from torch.distributed import pipelining

    group = ctx.group("pp")
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
           "interleaved": pipelining.ScheduleInterleaved1F1B}[schedule]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def build() -> Step:
        modules = split_model(build_model(cfg, options.seed, ctx.device), ctx, virtual=virtual)
        stages = [
            pipelining.PipelineStage(m, c * group.size + group.rank, group.size * virtual, ctx.device,
                                     group=group.process_group)
            for c, m in enumerate(modules)
        ]
        runner = cls(stages if virtual > 1 else stages[0], n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        optimizer = _optimizer(modules)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)

        def step(i: int) -> None:
            batch = tokens[i].to(ctx.device)
            args = (batch[:, :-1],) if first else ()
            runner.step(*args, target=batch[:, 1:] if last else None, losses=[] if last else None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return build


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    p = ctx.size("pp")
    if p < 2:
        raise UserError("bench pp compares pipeline schedules: run it with --nproc >= 2")
    cfg = config_from_dict({"model": {"preset": options.preset, "seq_len": options.seq_len}}).model
    if cfg.n_layers < p:
        raise UserError(
            f"bench pp with --nproc {p} needs a model of >= {p} layers; preset {options.preset!r} has "
            f"{cfg.n_layers}: use --model bench or fewer processes"
        )
    interleave = cfg.n_layers >= 2 * p  # else the interleaved contestants are left out (too few layers)
    tokens = _tokens(options)
    contestants = [
        Contestant(f"ours_{s}", _ours(ctx, cfg, options, tokens, s, v), counted=True)
        for s, v in OURS if v == 1 or interleave
    ]
    contestants += [
        Contestant(f"torch_{s}", _torch(ctx, cfg, options, tokens, s, v), counted=False)
        for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)) if v == 1 or interleave
    ]
    activation_bytes = options.micro_batch * options.seq_len * cfg.dim * 4
    facts = {
        "preset": options.preset, "pp": p, "micro_batches": MICRO_BATCHES,
        "activation_bytes": activation_bytes,
        "middle_rank_p2p_bytes": 2 * MICRO_BATCHES * activation_bytes,
        "bubble_theory_1f1b": round((p - 1) / (MICRO_BATCHES + p - 1), 3),
        "bubble_theory_interleaved": round((p - 1) / (2 * MICRO_BATCHES + p - 1), 3),
    }
    result = run_contest(ctx, "pp", contestants, options, reference="torch_1f1b", facts=facts)
    for schedule, v in OURS:
        if v == 1 or interleave:
            result.facts.update(_timeline(ctx, cfg, options, tokens, schedule, v))
    return result


def _timeline(ctx: ParallelContext, cfg: ModelConfig, options: BenchOptions, tokens: torch.Tensor,
              schedule: str, virtual: int) -> dict[str, object]:
    """One step after one untimed step, recorded: measured bubble fraction, live micro-batches
    per rank (gathered with one all-reduce of p numbers), and rank 0 writes the Chrome trace and
    PNG to bench-results/pp-n{p}-{schedule}.{json,png}."""
    stages = split_model(build_model(cfg, options.seed, ctx.device), ctx, virtual=virtual)
    micro = [(x[:, :-1], x[:, 1:]) for x in tokens[0].to(ctx.device).chunk(MICRO_BATCHES)]
    run_pipeline(stages, micro, ctx, schedule)
    timeline = Timeline()
    run_pipeline(stages, micro, ctx, schedule, timeline)
    ranks = timeline.gather(ctx)
    group = ctx.group("pp")
    live = torch.zeros(group.size, dtype=torch.float64)
    live[group.rank] = timeline.peak_live
    ctx.comm.all_reduce(live, group)
    if ctx.is_main:
        stem = Path("bench-results") / f"pp-n{group.size}-{schedule}"
        write_chrome_trace(ranks, stem.with_suffix(".json"))
        write_png(ranks, stem.with_suffix(".png"), title=f"{schedule}, p={group.size}, m={MICRO_BATCHES}")
    return {f"bubble_{schedule}": round(bubble_fraction(ranks), 3), f"live_{schedule}": [int(n) for n in live]}
