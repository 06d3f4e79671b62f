"""Scenario `ddp`: ndtrain's `DistributedDataParallel` against `torch.nn.parallel.DistributedDataParallel`.

Both train the same Llama (same preset, seed and initial weights) with AdamW on the same random
token batches (a different stream per rank, the same for both contestants), with the same bucket
cap, over the same `dp_cp` process group, with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`. Torch's DDP gets the options that make it do what ours does:
gradients as bucket views, no per-forward buffer broadcast (ours broadcasts buffers once, at
construction). Torch's DDP has its own levers built in and always on: a 1 MB first bucket and,
after the first iteration, buckets rebuilt in the order gradients were produced.

Ours takes the DDP levers of the options (README "DDP"): `first_bucket_mb` (default 1 MB, as
torch), `reorder_buckets`, `flat_adamw` (ours' AdamW replaced by `FlatAdamW` over the buckets) and
`overlap_optimizer` (each bucket updated as soon as it is averaged). Torch's contestant uses
`torch.optim.AdamW` with its defaults, as a user would write it, or with `torch_fused_adamw`
`torch.optim.AdamW(fused=True)`, so that a table can show both.

Expected communication per step and rank, G = gradient bytes: 2(N−1)/N · G (ring all-reduce),
for both; ours is counted by `ctx.comm`, both are measured on the loopback interface. Third
contestant `limit`: ours exactly, with every bucket collective replaced by nothing (0 bytes;
`ndtrain.bench.limit.NoCommBucket`).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel

from ndtrain.bench.harness import (
    LIMIT, BenchOptions, Contestant, ContestResult, Step, Workload, adamw_factory, levers, llama_workload, run_contest,
    training_step,
)
from ndtrain.bench.limit import NoCommBucket
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.flat_adamw import FlatAdamW

LR = 3e-4


def ours_step(ctx: ParallelContext, options: BenchOptions, work: Workload, *, communicate: bool = True) -> Step:
    """Ours with the options' levers; `communicate=False`: the same with no bucket collective (the limit)."""
    model = DistributedDataParallel(
        build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb,
        first_bucket_mb=options.first_bucket_mb, reorder_buckets=options.reorder_buckets,
        bucket_kind=None if communicate else NoCommBucket, host_slots=options.host_slots,
    )
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if options.flat_adamw:
        flat = FlatAdamW.replacing(model, optimizer)
        assert flat is not None
        flat.set_overlap(options.overlap_optimizer)
        optimizer = flat
    return training_step(model, optimizer, work.tokens)


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench ddp compares gradient synchronisation: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")

    def torch_ddp() -> Step:
        model = TorchDistributedDataParallel(
            build_model(work.model, options.seed, ctx.device), process_group=group.process_group,
            bucket_cap_mb=options.bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False,
        )
        return training_step(model, adamw_factory(LR, options.torch_fused_adamw)(model.parameters()), work.tokens)

    n = group.size
    facts = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": work.gradient_bytes,
        "ring_bytes": 2 * (n - 1) * work.gradient_bytes // n,
        "tokens_per_rank_step": options.micro_batch * options.seq_len,
        "levers": levers(options),
        "first_bucket_mb": options.first_bucket_mb,
    }
    contestants = [Contestant("ours", lambda: ours_step(ctx, options, work), counted=True),
                   Contestant("torch", torch_ddp, counted=False),
                   Contestant(LIMIT, lambda: ours_step(ctx, options, work, communicate=False), counted=True)]
    return run_contest(ctx, "ddp", contestants, options, reference="torch", facts=facts)
