"""Scenarios `zero1` (below) and `zero2` (`run_zero2`). `zero1`: ndtrain's `Zero1DataParallel` + `ZeroOptimizer` against PyTorch's DDP + `ZeroRedundancyOptimizer`.

Both train the same Llama (same preset, seed and initial weights) with AdamW (one parameter group,
the same LR) on the same random token batches (a different stream per rank, the same for both
contestants), with the same bucket cap, over the same `dp_cp` process group, with the same loop:
forward, backward, step, `zero_grad(set_to_none=True)`. Both shard only the optimizer state
(ZeRO stage 1): ours slices every flat bucket evenly over the ranks, reduce-scatters each gradient
bucket into the slices during backward and gathers the buckets after the step (on one CPU host
through its shared-memory ring, dist/host_stream.py, with the gradients left as autograd's own
`.grad`s, freed by `zero_grad(set_to_none=True)`; with `--no-host-slots` through gloo, one
broadcast per rank slice); torch's all-reduces the gradients, assigns whole parameters to ranks (greedily, by
size) and broadcasts each rank's parameters after the step. Torch's DDP gets the options of the `ddp` scenario: gradients
as bucket views, no per-forward buffer broadcast.

Expected per rank, Ψ trainable fp32 elements, Ψ' ≥ Ψ the padded flat buffers (ours), N ranks:
AdamW state 8Ψ/N bytes (exp_avg and exp_avg_sq; plus 4-byte step counters); communication per
step, ours (N−1)/N · 4Ψ' (gradient reduce-scatter) + (N−1)/N · 4Ψ' (parameter gather) =
2(N−1)/N · 4Ψ' (`comm_bytes`), torch's 2(N−1)/N · 4Ψ (all-reduce) + (N−1)/N · 4Ψ (broadcasts).
Ours is counted by `ctx.comm` (a broadcast once, at its root: the counted gather is 4Ψ'/N, equal to
the textbook volume at N = 2 only), both are measured on the loopback interface (gloo's
reduce-scatter sends an all-reduce's volume, so there ours moves as much as torch's DDP+ZeRO). After the contest, each contestant is
built once more and run for one step (AdamW's state is complete after its first step) to record
the optimizer-state bytes rank 0 actually holds: `ours_rank0_state_bytes`, `torch_rank0_state_bytes`.
Both scenarios have a third contestant, `limit` (`ndtrain.bench.limit`): the same step with no
communication and a full, unsharded AdamW step (more optimizer work than ZeRO's 1/N).
`--flat-adamw`: ours' and the limit's AdamW run torch's fused kernel (ours over its flat shard
segments, `fused_adamw_factory`, as `parallel.flat_adamw` does); `--torch-fused-adamw`: torch's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel

from ndtrain.bench.fsdp import fsdp2_model
from ndtrain.bench.harness import (
    BenchOptions, Contestant, ContestResult, Step, adamw_factory, from_rank0, levers, llama_workload, run_contest,
    training_step,
)
from ndtrain.bench.limit import limit_contestant
from ndtrain.errors import UserError
from ndtrain.dist.memory import optimizer_state_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.buckets import MB, pack
from ndtrain.parallel.data.zero1_gradients import Zero1DataParallel
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from ndtrain.parallel.data.zero2_gradients import Zero2DataParallel

LR = 3e-4

Built = tuple[Step, Callable[[], int], Callable[[], int]]  # step(i), optimizer-state bytes of this rank, Ψ' (or 0)


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench zero1 compares optimizer-state sharding: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")

    def ours() -> Built:
        model = Zero1DataParallel(build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb,
                                  host_slots=options.host_slots)
        optimizer = ZeroOptimizer(model, ctx, adamw_factory(LR, options.flat_adamw))
        return training_step(model, optimizer, work.tokens), optimizer.state_bytes, lambda: optimizer.padded_numel

    def torch_zero() -> Built:
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (~1.5 s),
        # which `ndtrain bench ddp` and importers of this module need not pay.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = TorchDistributedDataParallel(
            build_model(work.model, options.seed, ctx.device), process_group=group.process_group,
            bucket_cap_mb=options.bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False,
        )
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, process_group=group.process_group,
            **({"fused": True} if options.torch_fused_adamw else {}),
        )
        return training_step(model, optimizer, work.tokens), lambda: optimizer_state_bytes(optimizer.optim), lambda: 0

    grad_bytes = work.gradient_bytes
    n = group.size
    facts = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": grad_bytes,
        "expected_state_bytes": 2 * grad_bytes // n,  # 8Ψ/N: exp_avg + exp_avg_sq of one slice
        "tokens_per_rank_step": options.micro_batch * options.seq_len, "levers": levers(options),
    }
    contestants = [Contestant("ours", lambda: ours()[0], counted=True),
                   Contestant("torch", lambda: torch_zero()[0], counted=False),
                   limit_contestant(work, options, ctx, LR)]
    result = run_contest(ctx, "zero1", contestants, options, reference="torch", facts=facts)

    # Separate measurement: optimizer state held by rank 0 after a step, and our padded size Ψ'.
    measured: dict[str, int] = {}
    for name, build in (("ours", ours), ("torch", torch_zero)):
        step, state_bytes, padded = build()
        step(0)
        measured[f"{name}_rank0_state_bytes"] = from_rank0(ctx, state_bytes())
        if name == "ours":
            measured["padded_parameters"] = padded()  # Ψ', the same on every rank
        del step, state_bytes, padded
    volume = (n - 1) * 4 * measured["padded_parameters"] // n
    result.facts = {
        **facts,
        "padded_parameters": measured["padded_parameters"],
        "reduce_scatter_bytes": volume, "all_gather_bytes": volume, "comm_bytes": 2 * volume,
        "ours_rank0_state_bytes": measured["ours_rank0_state_bytes"],
        "torch_rank0_state_bytes": measured["torch_rank0_state_bytes"],
    }
    return result


def run_zero2(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    """Scenario `zero2`: our `Zero2DataParallel` + `ZeroOptimizer` against FSDP2 with `reshard_after_forward=False`.

    PyTorch has no separate ZeRO-2 wrapper; the closest equivalent is FSDP2's `fully_shard` per block
    and on the model with `reshard_after_forward=False`, which its documentation calls ZeRO-2:
    parameters are gathered once per step (in forward) and kept for backward, gradients are
    reduce-scattered, optimizer state is sharded. The difference: FSDP2 frees the gathered
    parameters after backward (4Ψ/N between steps, then gathers them in the next forward) where ours
    keeps the whole 4Ψ parameters and all-gathers them right after the optimizer step. The
    communication is the same volume: per step (N−1)/N · 4Ψ' reduce-scattered and all-gathered.
    Same model, data, seed, LR and loop as `zero1`; ours reduce-scatters in buckets of `bucket_mb`, on
    one host through shared-memory slots (`--no-host-slots`: through gloo; the pool's pages, 3 of the
    largest bucket per rank, are not counted in the state below). Expected model state per rank
    between steps: ours 4Ψ' + 4Ψ'/N + 8Ψ/N, torch's 4Ψ/N + 4Ψ/N + 8Ψ/N
    (`ours_rank0_state_bytes`, `torch_rank0_state_bytes`, measured after one step).
    """
    if ctx.world_size < 2:
        raise UserError("bench zero2 compares gradient sharding: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")
    n = group.size

    def ours() -> tuple[Step, Callable[[], int]]:
        model = Zero2DataParallel(build_model(work.model, options.seed, ctx.device), ctx, bucket_mb=options.bucket_mb,
                                  host_slots=options.host_slots)
        optimizer = ZeroOptimizer(model, ctx, adamw_factory(LR, options.flat_adamw))

        def state_bytes() -> int:
            return optimizer.parameter_bytes() + model.gradient_bytes + optimizer.state_bytes()

        return training_step(model, optimizer, work.tokens), state_bytes

    def torch_fsdp2() -> tuple[Step, Callable[[], int]]:
        model, optimizer, state_bytes = fsdp2_model(work, options, ctx, reshard_after_forward=False)
        return training_step(model, optimizer, work.tokens), state_bytes

    facts: dict[str, Any] = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": work.gradient_bytes,
        "tokens_per_rank_step": options.micro_batch * options.seq_len, "levers": levers(options),
    }
    contestants = [Contestant("ours", lambda: ours()[0], counted=True),
                   Contestant("torch", lambda: torch_fsdp2()[0], counted=False),
                   limit_contestant(work, options, ctx, LR)]
    result = run_contest(ctx, "zero2", contestants, options, reference="torch", facts=facts)

    measured: dict[str, int] = {}
    for name, build in (("ours", ours), ("torch", torch_fsdp2)):
        step, state_bytes = build()
        step(0)
        measured[f"{name}_rank0_state_bytes"] = from_rank0(ctx, state_bytes())
        del step, state_bytes
    padded = sum(-(-sum(p.numel() for p in run) // n) * n for run in _bucket_params(work, options))
    volume = (n - 1) * 4 * padded // n
    result.facts = {**facts, **measured, "padded_parameters": padded,
                    "reduce_scatter_bytes": volume, "all_gather_bytes": volume, "comm_bytes": 2 * volume}
    return result


def _bucket_params(work: Any, options: BenchOptions) -> list[list[torch.Tensor]]:
    """Our buckets' parameters (DDP's packing rule), to compute Ψ' without building the contestant."""
    params = [p for p in build_model(work.model, options.seed, "cpu").parameters() if p.requires_grad][::-1]
    return [[params[i] for i in run] for run in pack(params, max(1, int(options.bucket_mb * MB)))]
