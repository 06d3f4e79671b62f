"""`ndtrain bench SCENARIO`: launch local workers, run the scenario on each, report from rank 0.

The parent process checks the world (1 to `MAX_NPROC` local workers; on CUDA, no more workers
than visible GPUs, one each) and re-runs the command on `--nproc` workers (torchrun's agent); a
worker sets its thread count (the cores shared evenly, so 2 ranks on 2 cores get one each), joins
the world on `--device` (auto: CUDA with NCCL where a GPU is visible, else CPU with gloo), runs
the scenario, and rank 0 prints the table and writes the JSON result. For the data-parallel
benches (ddp, zero1, zero2, zero3) the parent then launches the workers once more per contestant
(`--memory-of NAME`, not a user flag) to measure each one's peak memory alone in fresh processes
(fresh_memory.py), added to the JSON and printed after the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ndtrain.bench import ddp, fsdp, tp, zero
from ndtrain.bench import dp_vs_ddp, ps
from ndtrain.bench import cp
from ndtrain.bench import pp
from ndtrain.bench import layouts
from ndtrain.bench import fresh_memory
from ndtrain.bench.harness import BenchOptions, ContestResult, MemoryMeasured
from ndtrain.config import MODEL_PRESETS, ParallelConfig
from ndtrain.errors import UserError
from ndtrain.launch import die_with_parent, in_worker, launch_local, set_worker_threads
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.config.options import Device, values

MAX_NPROC = 8  # local workers the benches are laid out and checked for


@dataclass(frozen=True)
class Scenario:
    """`run(ctx, options)` on every worker of a world laid out by `layout(world_size)`."""

    run: Callable[[ParallelContext, BenchOptions], ContestResult]
    layout: Callable[[int], ParallelConfig] = lambda world_size: ParallelConfig()
    fresh_memory: bool = False  # each contestant's memory also measured alone in fresh processes


SCENARIOS: dict[str, Scenario] = {
    "ddp": Scenario(ddp.run, fresh_memory=True),
    "zero1": Scenario(zero.run, fresh_memory=True),
    "zero2": Scenario(zero.run_zero2, fresh_memory=True),
    "zero3": Scenario(fsdp.run, fresh_memory=True),
    "tp": Scenario(tp.run, lambda world_size: ParallelConfig(tp=world_size)),
    "pp": Scenario(pp.run, lambda world_size: ParallelConfig(pp=world_size)),
    "cp": Scenario(cp.run, lambda world_size: ParallelConfig(cp=world_size)),
    "ps": Scenario(ps.run),
    "dp-vs-ddp": Scenario(dp_vs_ddp.run),
    "layouts": Scenario(layouts.run),
}
DEFAULTS = BenchOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=sorted(SCENARIOS), help="what to compare with PyTorch's own")
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help=f"local worker processes (1 to {MAX_NPROC})")
    parser.add_argument("--device", choices=values(Device), default="auto",
                        help="where the workers compute: auto = one CUDA GPU each (NCCL) if visible, else CPU (gloo)")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="threads per worker, 0 = cores / nproc")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps, metavar="N", help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=DEFAULTS.warmup, metavar="N", help="untimed steps before each run")
    parser.add_argument("--repeats", type=int, default=DEFAULTS.repeats, metavar="N",
                        help="runs of each contestant, alternating")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULTS.bucket_mb, metavar="X", help="gradient bucket cap (MB)")
    parser.add_argument("--micro-batch", type=int, default=DEFAULTS.micro_batch, metavar="N",
                        help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len, metavar="N", help="tokens per sequence")
    parser.add_argument("--model", dest="preset", choices=tuple(MODEL_PRESETS), default=DEFAULTS.preset,
                        help="model size preset (as `train --model`)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, metavar="N", help="seed of init and data")
    levers = parser.add_argument_group("DDP levers (scenario ddp; --flat-adamw and --torch-fused-adamw also zero1/zero2/zero3)")
    levers.add_argument("--first-bucket-mb", type=float, default=DEFAULTS.first_bucket_mb, metavar="X",
                        help="cap of ours' first bucket (MB); = --bucket-mb for none")
    for flag, what in (("--reorder-buckets", "ours packs its buckets in the order step 1 produced gradients"),
                       ("--flat-adamw", "ours uses the flat AdamW over its buckets (zero1/2/3: ours' and the limit's "
                                        "AdamW on torch's fused kernel)"),
                       ("--overlap-optimizer", "ours updates each bucket as soon as it is averaged (needs --flat-adamw)"),
                       ("--torch-fused-adamw", "torch's contestant uses torch.optim.AdamW(fused=True)")):
        levers.add_argument(flag, action="store_true", help=what)
    parser.add_argument("--no-host-slots", dest="host_slots", action="store_false",
                        help="ddp/zero1/zero2/zero3: ours communicates through the backend (gloo's sockets) instead of "
                             "shared memory between the ranks of one host (parallel.host_shared_memory=false)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result (default: bench-results/SCENARIO-nN.json)")
    parser.add_argument("--memory-of", default="", help=argparse.SUPPRESS)  # the parent's memory launches


def main(args: argparse.Namespace) -> int:
    options = BenchOptions(
        steps=args.steps, warmup=args.warmup, repeats=args.repeats, bucket_mb=args.bucket_mb,
        micro_batch=args.micro_batch, seq_len=args.seq_len, preset=args.preset, seed=args.seed,
        first_bucket_mb=args.first_bucket_mb, reorder_buckets=args.reorder_buckets, flat_adamw=args.flat_adamw,
        overlap_optimizer=args.overlap_optimizer, torch_fused_adamw=args.torch_fused_adamw,
        host_slots=args.host_slots, memory_of=args.memory_of,
    )
    options.validate()
    if not in_worker():
        check_world(args.nproc, args.device, torch.cuda.device_count())
        status = launch_local(["bench", *_worker_argv(args), *_out(args.out)], args.nproc)
        if status != 0 or not SCENARIOS[args.scenario].fresh_memory:
            return status

        def launch(extra: list[str]) -> int:
            return launch_local(["bench", *_worker_argv(args), *extra], args.nproc)

        return fresh_memory.measure_each(launch, args.out or _default_out(args.scenario, args.nproc))
    die_with_parent()  # a benchmark worker ends with its launcher, as a training worker does
    set_worker_threads(args.threads)
    scenario = SCENARIOS[args.scenario]
    ctx = init(dataclasses.replace(scenario.layout(args.nproc), device=args.device))
    try:
        result = scenario.run(ctx, options)
    except UserError as e:  # raised alike on every rank: say it once
        if ctx.is_main:
            print(f"ndtrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except MemoryMeasured as measured:  # a `--memory-of` launch: its figures for the parent
        if ctx.is_main:
            args.out.write_text(json.dumps(fresh_memory.record_memory(measured.record)) + "\n")
        return 0
    finally:
        ctx.destroy()
    if ctx.is_main:
        out = args.out or _default_out(args.scenario, ctx.world_size)
        result.write_json(out)
        print(result.table())
        print(f"written {out}")
    return 0


def check_world(nproc: int, device: str, gpus: int) -> None:
    """Refuse, in one line, a world the benches do not run: `nproc` outside 1..MAX_NPROC, or on CUDA
    (`device` cuda, or auto with `gpus` > 0 visible) more workers than GPUs."""
    if not 1 <= nproc <= MAX_NPROC:
        raise UserError(f"bench --nproc {nproc} is not supported: give 1 to {MAX_NPROC} local workers")
    if device == "cuda" and gpus == 0:
        raise UserError("bench --device cuda but no CUDA device is visible: use --device cpu (or auto)")
    if gpus and device != "cpu" and nproc > gpus:
        raise UserError(f"bench --nproc {nproc} needs one GPU per worker, {gpus} visible: give --nproc <= {gpus} "
                        "or --device cpu")


def _default_out(scenario: str, world_size: int) -> Path:
    return Path("bench-results") / f"{scenario}-n{world_size}.json"


def _out(path: Path | None) -> list[str]:
    return [] if path is None else ["--out", str(path)]


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The flags the workers need, less `--out` and `--memory-of` (given per launch)."""
    argv = [
        args.scenario, "--nproc", str(args.nproc), "--device", args.device, "--threads", str(args.threads),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
        "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--model", args.preset,
        "--seed", str(args.seed), "--first-bucket-mb", str(args.first_bucket_mb),
    ]
    argv += [flag for flag, on in (("--reorder-buckets", args.reorder_buckets), ("--flat-adamw", args.flat_adamw),
                                   ("--overlap-optimizer", args.overlap_optimizer),
                                   ("--torch-fused-adamw", args.torch_fused_adamw),
                                   ("--no-host-slots", not args.host_slots)) if on]
    return argv
