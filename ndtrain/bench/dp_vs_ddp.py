"""Scenario `dp-vs-ddp`: single-process `DataParallel` (threads over N replicas in rank 0) against
our DDP over N processes, at the same global batch (N × `--micro-batch` sequences per step).

- ddp (reference): every rank trains `DistributedDataParallel` (ndtrain.parallel.data.ddp) on its micro-batch;
  gradients all-reduced during backward (2(N−1)/N · G bytes per rank, G = gradient bytes).
- dataparallel: rank 0 alone runs `SingleProcessDataParallel` over N replicas of the model on
  its device (one Python thread per replica: N CPU "devices" here, N GPUs on a real machine) on
  the global batch (rank 0's stream repeated N times: same shapes, same work), steps AdamW on the
  master; the other ranks idle through the step. Per step, inside one process: (N−1) parameter
  broadcasts and gradient reductions through device 0, no inter-process communication.
Both: same preset, seed, AdamW (lr 3e-4), `zero_grad(set_to_none=True)` loop. The harness
times the slowest rank, i.e. rank 0 for dataparallel. Threads: each process gets cores / N
intra-op threads, so both contestants use the same cores (N processes vs N threads in one).
"""

from __future__ import annotations

import torch

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, llama_workload, run_contest, training_step
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.single_process import SingleProcessDataParallel

LR = 3e-4


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench dp-vs-ddp compares N processes with N replicas in one process: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    n = ctx.world_size

    def ddp() -> Step:
        model = DistributedDataParallel(build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb)
        return training_step(model, torch.optim.AdamW(model.parameters(), lr=LR), work.tokens)

    def dataparallel() -> Step:
        if ctx.rank != 0:
            return lambda i: None
        model = SingleProcessDataParallel(build_model(work.model, options.seed, ctx.device), [ctx.device] * n)
        return training_step(model, torch.optim.AdamW(model.parameters(), lr=LR), work.tokens.repeat(1, n, 1))

    facts = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": work.gradient_bytes,
        "replicas": n, "global_batch": n * options.micro_batch,
        "ring_bytes": 2 * (n - 1) * work.gradient_bytes // n,
    }
    contestants = [Contestant("ddp", ddp, counted=True), Contestant("dataparallel", dataparallel, counted=False)]
    return run_contest(ctx, "dp-vs-ddp", contestants, options, reference="ddp", facts=facts)
