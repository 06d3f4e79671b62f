"""Scenario `zero1`: ndtrain's `DataParallel` + `ZeroOptimizer` against PyTorch's DDP + `ZeroRedundancyOptimizer`.

Both train the same Llama (same preset, seed and initial weights) with AdamW (one parameter group,
the same LR) on the same random token batches (a different stream per rank, the same for both
contestants), with the same bucket cap, over the same `dp_cp` process group, with the same loop:
forward, backward, step, `zero_grad(set_to_none=True)`. Both shard only the optimizer state
(ZeRO stage 1): ours slices every flat bucket evenly over the ranks and all-gathers the buckets
after the step; torch's assigns whole parameters to ranks (greedily, by size) and broadcasts each
rank's parameters after the step. Torch's DDP gets the options of the `ddp` scenario: gradients
as bucket views, no per-forward buffer broadcast.

Expected per rank, Ψ trainable fp32 elements, Ψ' ≥ Ψ the padded flat buffers (ours), N ranks:
AdamW state 8Ψ/N bytes (exp_avg and exp_avg_sq; plus 4-byte step counters), and communication per
step 2(N−1)/N · 4Ψ (gradient all-reduce) + (N−1)/N · 4Ψ' (parameter all-gather); ours is counted
by `ctx.comm`, both are measured on the loopback interface. After the contest, each contestant is
built once more and run for one step (AdamW's state is complete after its first step) to record
the optimizer-state bytes rank 0 actually holds: `ours_rank0_state_bytes`, `torch_rank0_state_bytes`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, llama_workload, run_contest, training_step
from ndtrain.errors import UserError
from ndtrain.memory import optimizer_state_bytes
from ndtrain.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.ddp import DataParallel
from ndtrain.parallel.zero import ZeroOptimizer

LR = 3e-4

Built = tuple[Step, Callable[[], int], Callable[[], int]]  # step(i), optimizer-state bytes of this rank, Ψ' (or 0)


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench zero1 compares optimizer-state sharding: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")

    def ours() -> Built:
        model = DataParallel(build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb)
        optimizer = ZeroOptimizer(model, ctx, lambda groups: torch.optim.AdamW(groups, lr=LR))
        return training_step(model, optimizer, work.tokens), optimizer.state_bytes, lambda: optimizer.padded_numel

    def torch_zero() -> Built:
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (~1.5 s),
        # which `ndtrain bench ddp` and importers of this module need not pay.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = DistributedDataParallel(
            build_model(work.model, options.seed, ctx.device), process_group=group.process_group,
            bucket_cap_mb=options.bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False,
        )
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, process_group=group.process_group,
        )
        return training_step(model, optimizer, work.tokens), lambda: optimizer_state_bytes(optimizer.optim), lambda: 0

    grad_bytes = work.gradient_bytes
    n = group.size
    facts = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": grad_bytes,
        "expected_state_bytes": 2 * grad_bytes // n,  # 8Ψ/N: exp_avg + exp_avg_sq of one slice
        "tokens_per_rank_step": options.micro_batch * options.seq_len,
    }
    contestants = [Contestant("ours", lambda: ours()[0], counted=True),
                   Contestant("torch", lambda: torch_zero()[0], counted=False)]
    result = run_contest(ctx, "zero1", contestants, options, reference="torch", facts=facts)

    # Separate measurement: optimizer state held by rank 0 after a step, and our padded size Ψ'.
    measured: dict[str, int] = {}
    for name, build in (("ours", ours), ("torch", torch_zero)):
        step, state_bytes, padded = build()
        step(0)
        measured[f"{name}_rank0_state_bytes"] = _from_rank0(ctx, state_bytes())
        if name == "ours":
            measured["padded_parameters"] = padded()  # Ψ', the same on every rank
        del step, state_bytes, padded
    all_reduce_bytes = 2 * (n - 1) * grad_bytes // n
    all_gather_bytes = (n - 1) * 4 * measured["padded_parameters"] // n
    result.facts = {
        **facts,
        "padded_parameters": measured["padded_parameters"],
        "all_reduce_bytes": all_reduce_bytes, "all_gather_bytes": all_gather_bytes,
        "comm_bytes": all_reduce_bytes + all_gather_bytes,
        "ours_rank0_state_bytes": measured["ours_rank0_state_bytes"],
        "torch_rank0_state_bytes": measured["torch_rank0_state_bytes"],
    }
    return result


def _from_rank0(ctx: ParallelContext, value: int) -> int:
    """Rank 0's `value` on every rank, so that every rank reports the same facts."""
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    ctx.comm.broadcast(tensor, ctx.group("world"), src=0)
    return int(tensor.item())
