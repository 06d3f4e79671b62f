"""Scenario `zero3`: ndtrain's `FullyShardedDataParallel` against PyTorch's FSDP2 (`fully_shard`).

Both train the same Llama (same preset, seed and initial weights) with AdamW (one parameter group,
the same LR) on the same random token batches (a different stream per rank, the same for both
contestants), over the same `dp_cp` process group, with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`. Both shard parameters, gradients and optimizer state (ZeRO stage 3)
with one unit per transformer block plus the root (embedding, final norm, head), fp32 throughout,
parameters freed after forward and gathered again for backward: ours wraps with `layers.*`
and, on one CPU host, gathers and reduce-scatters through its shared-memory ring (dist/host_stream.py;
`--no-host-slots`: through gloo); torch's gets `fully_shard` on every block and then on the model.

Expected per rank, Ψ fp32 elements, Ψ' ≥ Ψ padded (ours), N ranks, U blocks: model state
16Ψ/N bytes between steps (4 master + 4 gradient + 8 AdamW), and communication per step
(N−1)/N · 4 · (Ψ'_root + 2 Ψ'_blocks) all-gathered + (N−1)/N · 4Ψ' reduce-scattered, in
1 + 2U and 1 + U calls (ours counted by `ctx.comm`, both measured on the loopback interface).
After the contest each contestant is built once more and run for one step, and rank 0's
model-state bytes (local shards of parameters and gradients, and the optimizer's state) are
recorded: `ours_rank0_state_bytes`, `torch_rank0_state_bytes`. Third contestant `limit`
(`ndtrain.bench.limit`): the unsharded model's step with no gather/reduce-scatter (0 bytes) and a
full AdamW step, all parameters resident. `--flat-adamw`: ours' and the limit's AdamW on torch's
fused kernel; `--torch-fused-adamw`: FSDP2's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ndtrain.bench.harness import (
    BenchOptions, Contestant, ContestResult, Step, Workload, adamw_factory, from_rank0, levers, llama_workload,
    run_contest, training_step,
)
from ndtrain.bench.limit import limit_contestant
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.zero3_parameters import FullyShardedDataParallel

LR = 3e-4

Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], int]]  # model, optimizer, model-state bytes of this rank


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    if ctx.world_size < 2:
        raise UserError("bench zero3 compares parameter sharding: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    group = ctx.group("dp_cp")

    def ours() -> Built:
        model = FullyShardedDataParallel(build_model(work.model, options.seed, ctx.device), ctx, wrap=("layers.*",),
                                         host_slots=options.host_slots)
        optimizer = adamw_factory(LR, options.flat_adamw)(model.parameter_groups())
        return model, optimizer, lambda: sum(model.state_bytes().values()) + _local_state_bytes(optimizer)

    def torch_fsdp() -> Built:
        return fsdp2_model(work, options, ctx, reshard_after_forward=True)

    def stepper(build: Callable[[], Built]) -> Callable[[], Step]:
        def make() -> Step:
            model, optimizer, _ = build()
            return training_step(model, optimizer, work.tokens)
        return make

    n = group.size
    facts: dict[str, Any] = {
        "preset": options.preset, "parameters": work.parameters, "gradient_bytes": work.gradient_bytes,
        "expected_state_bytes": 4 * work.gradient_bytes // n,  # 16Ψ/N
        "tokens_per_rank_step": options.micro_batch * options.seq_len, "levers": levers(options),
    }
    contestants = [Contestant("ours", stepper(ours), counted=True),
                   Contestant("torch", stepper(torch_fsdp), counted=False),
                   limit_contestant(work, options, ctx, LR)]
    result = run_contest(ctx, "zero3", contestants, options, reference="torch", facts=facts)

    # Separate measurement: model-state bytes held by rank 0 after one step (before zero_grad).
    measured: dict[str, int] = {}
    for name, build in (("ours", ours), ("torch", torch_fsdp)):
        model, optimizer, state_bytes = build()
        model(work.tokens[0, :, :-1], work.tokens[0, :, 1:]).backward()
        optimizer.step()
        measured[f"{name}_rank0_state_bytes"] = from_rank0(ctx, state_bytes())
        if name == "ours":  # ours is FullyShardedDataParallel: its units give the padded sizes
            units = model.units
            root = sum(u.padded for u in units if u.name == "")
            blocks = sum(u.padded for u in units if u.name != "")
            measured["padded_parameters"] = root + blocks
            measured["all_gather_bytes"] = (n - 1) * 4 * (root + 2 * blocks) // n
            measured["reduce_scatter_bytes"] = (n - 1) * 4 * (root + blocks) // n
        del model, optimizer, state_bytes
    result.facts = {**facts, **measured,
                    "comm_bytes": measured["all_gather_bytes"] + measured["reduce_scatter_bytes"]}
    return result


def fsdp2_model(work: Workload, options: BenchOptions, ctx: ParallelContext, *, reshard_after_forward: bool) -> Built:
    """PyTorch's FSDP2: `fully_shard` on every block and the root over the dp_cp group, AdamW."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(ctx.group("dp_cp").process_group, device_type=ctx.device.type)
    model = build_model(work.model, options.seed, ctx.device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = adamw_factory(LR, options.torch_fused_adamw)(model.parameters())

    def state_bytes() -> int:
        tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
        return sum(_local_bytes(t) for t in tensors) + _local_state_bytes(optimizer)

    return model, optimizer, state_bytes


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
