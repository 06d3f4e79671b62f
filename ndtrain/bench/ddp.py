"""Scenario `ddp`: ndtrain's `DataParallel` against `torch.nn.parallel.DistributedDataParallel`.

Both train the same Llama (same preset, seed and initial weights) with AdamW on the same random
token batches (a different stream per rank, the same for both contestants), with the same bucket
cap, over the same `dp_cp` process group, with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`. Torch's DDP gets the options that make it do what ours does:
gradients as bucket views, no per-forward buffer broadcast (ours broadcasts buffers once, at
construction).

Expected communication per step and rank, G = gradient bytes: 2(N−1)/N · G (ring all-reduce),
for both; ours is counted by `ctx.comm`, both are measured on the loopback interface.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, run_contest
from ndtrain.config import config_from_dict
from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.ddp import DataParallel

LR = 3e-4


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench ddp compares gradient synchronisation: run it with --nproc >= 2")
    cfg = config_from_dict({"model": {"preset": options.preset, "seq_len": options.seq_len}}).model
    group = ctx.group("dp_cp")
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + ctx.rank)
    tokens = torch.randint(0, cfg.vocab_size, (options.warmup + options.steps, options.micro_batch,
                                               options.seq_len + 1), generator=generator).to(ctx.device)

    def training(model: torch.nn.Module) -> Step:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(i: int) -> None:
            model(tokens[i, :, :-1], tokens[i, :, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def ours() -> Step:
        model = build_model(cfg, options.seed, ctx.device)
        return training(DataParallel(model, ctx, bucket_mb=options.bucket_mb))

    def torch_ddp() -> Step:
        model = build_model(cfg, options.seed, ctx.device)
        return training(DistributedDataParallel(
            model, process_group=group.process_group, bucket_cap_mb=options.bucket_mb,
            gradient_as_bucket_view=True, forward_sync_buffers=False,
        ))

    reference_model = build_model(cfg, options.seed, "cpu")
    params = sum(p.numel() for p in reference_model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in reference_model.parameters() if p.requires_grad)
    del reference_model
    n = group.size
    facts = {
        "preset": options.preset, "parameters": params, "gradient_bytes": grad_bytes,
        "ring_bytes": 2 * (n - 1) * grad_bytes // n, "tokens_per_rank_step": options.micro_batch * options.seq_len,
    }
    contestants = [Contestant("ours", ours, counted=True), Contestant("torch", torch_ddp, counted=False)]
    return run_contest(ctx, "ddp", contestants, options, reference="torch", facts=facts)
