"""Scenario `ddp`: ndtrain's `DistributedDataParallel` against `torch.nn.parallel.DistributedDataParallel`.

Both train the same Llama (same preset, seed and initial weights) with AdamW on the same random
token batches (a different stream per rank, the same for both contestants), with the same bucket
cap, over the same `dp_cp` process group, with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`. Torch's DDP gets the options that make it do what ours does:
gradients as bucket views, no per-forward buffer broadcast (ours broadcasts buffers once, at
construction).

Expected communication per step and rank, G = gradient bytes: 2(N−1)/N · G (ring all-reduce),
for both; ours is counted by `ctx.comm`, both are measured on the loopback interface. Third
contestant `limit` (`ndtrain.bench.limit`): the same step with no communication (0 bytes).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, llama_workload, run_contest, training_step
from ndtrain.bench.limit import limit_contestant
from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.ddp import DistributedDataParallel

LR = 3e-4


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench ddp compares gradient synchronisation: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")

    def ours() -> Step:
        model = DistributedDataParallel(build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb)
        return training_step(model, torch.optim.AdamW(model.parameters(), lr=LR), work.tokens)

    def torch_ddp() -> Step:
        model = TorchDistributedDataParallel(
            build_model(work.model, options.seed, ctx.device), process_group=group.process_group,
            bucket_cap_mb=options.bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False,
        )
        return training_step(model, torch.optim.AdamW(model.parameters(), lr=LR), work.tokens)

    n = group.size
    facts = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": work.gradient_bytes,
        "ring_bytes": 2 * (n - 1) * work.gradient_bytes // n,
        "tokens_per_rank_step": options.micro_batch * options.seq_len,
    }
    contestants = [Contestant("ours", ours, counted=True), Contestant("torch", torch_ddp, counted=False),
                   limit_contestant(work, options, ctx, LR)]
    return run_contest(ctx, "ddp", contestants, options, reference="torch", facts=facts)
