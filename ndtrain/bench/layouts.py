"""Scenario `layouts`: the Engine's step time under many layouts of one world, for checking the planner.

Every contestant is one layout `ParallelConfig(dp, tp, pp, zero, pp_schedule, ...)` of the same
world (4 processes: `ndtrain bench layouts --nproc 4`). Its process groups are built once, before
the contest, by `ndtrain.dist.mesh.init` on the already joined world (init on an initialised world only
adds groups); all layouts share the outer context's `Communicator`, so their wire bytes are counted.
Each builds an `Engine` around the same Llama (preset, seed) with AdamW and trains on the same
global batch: B = 8 sequences per step (the same stream on every rank), split over the dp ranks
(B/dp each) and cut into micro-batches of 1 sequence, so m = B/dp ≥ 2p for every pipeline here.
The harness alternates the layouts over `--repeats` runs (W warmup, S timed steps each) and reports
the median over timed steps of the slowest rank's step time; the reference is plain DDP (dp4).
Layouts with more pipeline chunks (pp·v) than the preset has layers are left out (facts "skipped").

What each layout communicates is in engine.py and the strategy modules (per step, Ψ parameters
of a rank's stage and tp shard, N its dp group, m = B/dp micro-batches): DDP 2(N−1)/N·4Ψ; tp 4
all-reduces per layer and micro-batch; pp 2 activations per boundary and micro-batch; ZeRO-1 its gradient
collective (zero1_optimizer.py) and an all-gather of the updated weights; ZeRO-2 (also inside each tp coordinate's dp
group under tp, `dp2-tp2-zero2`) a reduce-scatter every micro-batch and the all-gather once;
ZeRO-3 under pp (`dp2-pp2-zero3`: units per stage, 1F1B) every micro-batch gathers the stage's
units for the forward, the blocks again for the backward, and reduce-scatters them all
(zero3_parameters.py). `--micro-batch` is not used: B and the micro-batch size are fixed so that
the JSON (facts "global_batch", "micro_batch_size", "layouts") maps each contestant onto a
planner `Layout` (`ndtrain plan --validate`). The facts also record the preset's parameter count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ndtrain.bench.harness import MB, BenchOptions, Contestant, ContestResult, Step, run_contest
from ndtrain.config import ModelConfig, ParallelConfig, config_from_dict
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.models.llama import build_model

LR = 3e-4
GLOBAL_BATCH = 8
MICRO_BATCH_SIZE = 1
WORLD = 4

# name -> the ParallelConfig fields that differ from the defaults; dp is given explicitly.
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4": dict(dp=4),
    "dp4-zero1": dict(dp=4, zero=1),
    "dp4-zero2": dict(dp=4, zero=2),
    "dp4-zero3": dict(dp=4, zero=3),
    "dp2-tp2": dict(dp=2, tp=2),
    "dp2-tp2-sp": dict(dp=2, tp=2, sequence_parallel=True),
    "dp2-tp2-zero1": dict(dp=2, tp=2, zero=1),
    "dp2-tp2-zero2": dict(dp=2, tp=2, zero=2),
    "dp2-tp2-sp-zero2": dict(dp=2, tp=2, sequence_parallel=True, zero=2),
    "dp2-pp2-1f1b": dict(dp=2, pp=2, pp_schedule="1f1b"),
    "dp2-pp2-zero3": dict(dp=2, pp=2, pp_schedule="1f1b", zero=3),
    "tp2-pp2-1f1b": dict(dp=1, tp=2, pp=2, pp_schedule="1f1b"),
    "tp2-pp2-interleaved": dict(dp=1, tp=2, pp=2, pp_schedule="interleaved", pp_virtual=2),
    "pp4-1f1b": dict(dp=1, pp=4, pp_schedule="1f1b"),
    "pp4-gpipe": dict(dp=1, pp=4, pp_schedule="gpipe"),
    "pp4-zb": dict(dp=1, pp=4, pp_schedule="zb"),
}
REFERENCE = "dp4"
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "zero", "pp_schedule", "pp_virtual", "sequence_parallel", "recompute",
                 "precision")


def layout_fields(config: ParallelConfig) -> dict[str, Any]:
    """The fields of a layout that the JSON result records (what the planner's Layout is made from)."""
    return {name: getattr(config, name) for name in LAYOUT_FIELDS}


def _tokens(cfg: ModelConfig, options: BenchOptions) -> torch.Tensor:
    """[warmup + steps, B, seq_len + 1]: the same global batches on every rank."""
    generator = torch.Generator().manual_seed(options.seed * 1_000_003)
    shape = (options.warmup + options.steps, GLOBAL_BATCH, options.seq_len + 1)
    return torch.randint(0, cfg.vocab_size, shape, generator=generator)


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def _engine(ctx: ParallelContext, parallel: ParallelConfig, cfg: ModelConfig, options: BenchOptions,
            tokens: torch.Tensor) -> Callable[[], Step]:
    def build() -> Step:
        engine = Engine(lambda: build_model(cfg, options.seed), _adamw, ctx, parallel)
        dp, rank = ctx.size("dp"), ctx.coord("dp")
        micro_batches = GLOBAL_BATCH // dp // MICRO_BATCH_SIZE

        def step(i: int) -> None:
            mine = tokens[i].chunk(dp)[rank]
            x, y = mine[:, :-1], mine[:, 1:]
            engine.train_step(list(zip(x.chunk(micro_batches), y.chunk(micro_batches))))

        return step

    return build


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size != WORLD:
        raise UserError(f"bench layouts is laid out for {WORLD} processes: run it with --nproc {WORLD}")
    cfg = config_from_dict({"model": {"preset": options.preset, "seq_len": options.seq_len}}).model
    if cfg.n_heads % 2 or cfg.n_kv_heads % 2:
        raise UserError(
            f"bench layouts has tp=2 layouts: preset {options.preset!r} has {cfg.n_heads} heads and "
            f"{cfg.n_kv_heads} kv heads, both must be even: use --model bench (or bench-25m, bench-100m)"
        )
    tokens = _tokens(cfg, options)
    configs = {name: ParallelConfig(**fields, device=ctx.device.type) for name, fields in LAYOUTS.items()}
    skipped = [name for name, c in configs.items() if c.pp * c.pp_virtual > cfg.n_layers]  # too few layers
    configs = {name: c for name, c in configs.items() if name not in skipped}
    contexts = {
        name: dataclasses.replace(init(config), comm=ctx.comm)  # new groups, one counted communicator
        for name, config in configs.items()
    }
    contestants = [
        Contestant(name, _engine(contexts[name], configs[name], cfg, options, tokens), counted=True) for name in configs
    ]
    facts = {
        "preset": options.preset, "parameters": cfg.parameter_count(), "global_batch": GLOBAL_BATCH,
        "micro_batch_size": MICRO_BATCH_SIZE, "skipped": skipped,
        "layouts": {name: layout_fields(config) for name, config in configs.items()},
    }
    result = run_contest(ctx, "layouts", contestants, options, reference=REFERENCE, facts=facts)
    return LayoutsResult(**vars(result))


class LayoutsResult(ContestResult):
    """The contest's result with a table of one row per layout (its fields, step time, bytes, peak)."""

    def table(self) -> str:
        f = self.facts
        lines = [
            f"layouts on {self.world_size} ranks — preset {f['preset']} ({f['parameters'] / 1e6:.1f} M parameters), "
            f"B={f['global_batch']} sequences, micro-batch {f['micro_batch_size']}"
            + (f", skipped (too few layers): {', '.join(f['skipped'])}" if f["skipped"] else ""),
            f"{'layout':<21}{'dp':>3}{'tp':>3}{'pp':>3}{'zero':>5}{'schedule':>15}{'sp':>4}"
            f"{'median step':>13}{'ratio':>7}{'counted/step':>14}{'peak/rank':>11}",
        ]
        for name, s in self.summary().items():
            c = f["layouts"][name]
            schedule = "-" if c["pp"] == 1 else c["pp_schedule"] + (f"×{c['pp_virtual']}" if c["pp_virtual"] > 1 else "")
            lines.append(
                f"{name:<21}{c['dp']:>3}{c['tp']:>3}{c['pp']:>3}{c['zero']:>5}{schedule:>15}"
                f"{'on' if c['sequence_parallel'] else '-':>4}{s['median_step_s'] * 1e3:>10.1f} ms{s['ratio']:>7.3f}"
                f"{s['comm_bytes_per_step'] / MB:>11.2f} MB{max(s['peak_bytes']) / MB:>8.0f} MB"
            )
        lines.append(f"median over timed steps of the slowest rank; ratio to {self.reference}; bytes per rank; "
                     "MB = 2^20 bytes")
        return "\n".join(lines)
