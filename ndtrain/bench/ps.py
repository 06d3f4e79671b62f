"""Scenario `ps`: parameter-server sync vs async vs ssp, with and without a straggler.

World: the last rank is the server (S = 1), ranks 0..W−1 are workers (W = world − 1 ≥ 1). Six
configurations: {sync, async, ssp (staleness 2)} × {no straggler, worker W−1 2× slower}. Each
trains the same Llama (preset, seed) with AdamW (lr 3e-4) on real text (the standard library's
source, seeded windows per worker and step, `--micro-batch` sequences of `--seq-len` bytes
per push) for `--warmup` + `--steps` pushes per worker; configurations take turns,
`--repeats` times (order reversed on every other repeat).

Measured per run (timed steps only): pushes/s of each worker (its steps / its time in them; the
wait of its last pull for the others' final pushes is not counted); throughput = the sum of the
workers' rates × samples per push (the rate while all work: with a straggler, sync runs everyone
at its pace, async lets the others go on); staleness of every applied gradient (server); the
training loss of worker 0 after each step with its time since the run started. "Loss after a
fixed time": the budget T is the shortest median time worker 0 needs for its steps, and each
configuration reports worker 0's mean loss over its last 5 steps finished by T (median over
runs). Not a parity contest: the harness's two-contestant table does not apply, so this
scenario writes its own table and JSON (same convention: `write_json`, `table`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ndtrain.bench.harness import BenchOptions
from ndtrain.config import PSConfig, config_from_dict
from ndtrain.data.corpus import TokenWindows, load_corpus
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.ps.messages import PSSetup
from ndtrain.ps.server import ParameterServer
from ndtrain.ps.worker import PSWorker

LR = 3e-4
STALENESS = 2
SLOW_FACTOR = 2.0
LAST = 5  # steps averaged for the loss at the time budget


@dataclass
class PSRun:
    samples_per_s: float
    wall_s: float               # the slowest worker's timed steps, final wait included
    pushes_per_s: list[float]   # per worker
    max_staleness: int
    mean_staleness: float
    curve: list[tuple[float, float]]  # worker 0: (seconds since the timed start, loss)


@dataclass
class PSBenchResult:
    world_size: int
    options: dict[str, Any]
    facts: dict[str, Any]
    runs: dict[str, list[PSRun]] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, Any]]:
        budget = min(statistics.median(r.curve[-1][0] for r in runs) for runs in self.runs.values())
        sync = statistics.median(r.samples_per_s for r in self.runs["sync"])
        sync_slow = statistics.median(r.samples_per_s for r in self.runs["sync+straggler"])
        out = {}
        for name, runs in self.runs.items():
            throughput = statistics.median(r.samples_per_s for r in runs)
            base = sync_slow if name.endswith("+straggler") else sync
            losses = []
            for r in runs:
                done = [loss for t, loss in r.curve if t <= budget] or [r.curve[0][1]]
                losses.append(statistics.fmean(done[-LAST:]))
            out[name] = {
                "samples_per_s": throughput, "ratio_to_sync": throughput / base,
                "pushes_per_s": [statistics.median(r.pushes_per_s[w] for r in runs) for w in range(len(runs[0].pushes_per_s))],
                "max_staleness": max(r.max_staleness for r in runs),
                "mean_staleness": statistics.median(r.mean_staleness for r in runs),
                "wall_s": statistics.median(r.wall_s for r in runs), "loss_at_budget": statistics.median(losses), "budget_s": budget,
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {"scenario": "ps", "world_size": self.world_size, "options": self.options, "facts": self.facts,
                "summary": self.summary(), "runs": {k: [asdict(r) for r in v] for k, v in self.runs.items()}}

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.facts.items())
        lines = [f"ps on {self.world_size} ranks — {facts}",
                 f"{'mode':<18}{'samples/s':>11}{'vs sync':>9}{'pushes/s per worker':>24}{'staleness max/mean':>20}"
                 f"{'loss @ T':>10}"]
        for name, s in self.summary().items():
            pushes = " ".join(f"{p:.2f}" for p in s["pushes_per_s"])
            lines.append(f"{name:<18}{s['samples_per_s']:>11.2f}{s['ratio_to_sync']:>9.3f}{pushes:>24}"
                         f"{s['max_staleness']:>12}/{s['mean_staleness']:<7.2f}{s['loss_at_budget']:>10.4f}")
        budget = next(iter(self.summary().values()))["budget_s"]
        lines.append(f"vs sync = throughput / sync's (with a straggler: / sync+straggler's); medians over runs; "
                     f"loss @ T: worker 0's mean loss over its last {LAST} steps done by T = {budget:.1f} s")
        return "\n".join(lines)


def run(ctx: ParallelContext, options: BenchOptions) -> PSBenchResult:
    if ctx.world_size < 2:
        raise UserError("bench ps needs a server and at least one worker: run it with --nproc >= 2 (3 or more to compare modes)")
    workers = ctx.world_size - 1
    model_cfg = config_from_dict({"model": {"preset": options.preset, "seq_len": options.seq_len}}).model
    windows = TokenWindows(load_corpus(None, 0.02).train, options.seq_len, name="train")
    configs = {}
    for mode in ("sync", "async", "ssp"):
        configs[mode] = PSConfig(servers=1, mode=mode, staleness=STALENESS)
        configs[f"{mode}+straggler"] = PSConfig(servers=1, mode=mode, staleness=STALENESS,
                                                slow_worker=f"{workers - 1}:{SLOW_FACTOR}")
    result = PSBenchResult(ctx.world_size, asdict(options), {
        "preset": options.preset, "workers": workers, "servers": 1, "ssp_staleness": STALENESS,
        "straggler": f"rank {workers - 1} x{SLOW_FACTOR}", "samples_per_push": options.micro_batch,
    })
    result.runs = {name: [] for name in configs}
    for repeat in range(options.repeats):
        for name in list(configs) if repeat % 2 == 0 else list(configs)[::-1]:
            result.runs[name].append(_one_run(ctx, configs[name], model_cfg, windows, options))
    return result


def _one_run(ctx: ParallelContext, ps: PSConfig, model_cfg: Any, windows: TokenWindows, options: BenchOptions) -> PSRun:
    total = options.warmup + options.steps
    model = build_model(model_cfg, options.seed, ctx.device)
    setup = PSSetup.build(model, ctx, ps, total)
    workers = setup.roles.workers
    # Layout: wall time per worker (with the final wait), pushes/s per worker, staleness max and mean, worker 0's curve.
    values = torch.zeros(2 * workers + 2 + 2 * options.steps, dtype=torch.float64)
    curve = 2 * workers + 2
    ctx.comm.barrier(ctx.group("world"))
    if setup.roles.is_server(ctx.rank):
        server = ParameterServer(model, ctx, setup, lambda groups: torch.optim.AdamW(groups, lr=LR))
        applied = [a.staleness for a in server.serve().applications if a.step >= options.warmup]
        values[2 * workers] = max(applied)
        values[2 * workers + 1] = sum(applied) / len(applied)
    else:
        worker = PSWorker(model, ctx, setup)
        generator = torch.Generator().manual_seed(options.seed * 7919 + ctx.rank)
        start, busy = time.perf_counter(), 0.0
        for step in range(total):
            if step == options.warmup:
                start, busy = time.perf_counter(), worker.report.seconds
            index = torch.randint(0, len(windows), (options.micro_batch,), generator=generator).tolist()
            x, y, _ = (torch.stack(t) for t in zip(*(windows[i] for i in index)))
            loss = worker.train_step([(x, y)])
            if step >= options.warmup and ctx.rank == 0:
                i = step - options.warmup
                values[curve + i], values[curve + options.steps + i] = time.perf_counter() - start, loss
        values[ctx.rank] = time.perf_counter() - start
        values[workers + ctx.rank] = options.steps / (worker.report.seconds - busy)
    ctx.comm.all_reduce(values, ctx.group("world"))
    return PSRun(
        samples_per_s=values[workers : 2 * workers].sum().item() * options.micro_batch,
        wall_s=values[:workers].max().item(),
        pushes_per_s=values[workers : 2 * workers].tolist(),
        max_staleness=int(values[2 * workers].item()), mean_staleness=values[2 * workers + 1].item(),
        curve=list(zip(values[curve : curve + options.steps].tolist(), values[curve + options.steps :].tolist())),
    )
