"""Scenario `tp`: ndtrain's tensor parallelism against DTensor's `parallelize_module`, without and with
sequence parallelism.

All four contestants train the same Llama (same preset, seed and initial weights) with AdamW on
the same random token batches — the same on every rank, since the tp ranks share one batch —
over the same tp group (the whole world), with the same loop: forward, backward, step,
`zero_grad(set_to_none=True)`:
- `ours`, `ours_sp`: `parallelize(model, ctx, sequence_parallel=...)` with the built-in Llama plan
  (vocab-parallel embedding, column/row-parallel attention and SwiGLU, vocab-parallel loss);
- `torch`, `torch_sp`: the same split written with DTensor styles (torchtitan's Llama plan):
  `RowwiseParallel` embedding, `ColwiseParallel` q/k/v/w1/w3 and head, `RowwiseParallel` wo/w2,
  and with sequence parallelism `SequenceParallel` norms and `PrepareModuleInput` (sequence
  all-gather) on attention and feed-forward; the loss on vocabulary shards under `loss_parallel()`.
Ratios are against `torch` (compare `ours_sp` with `torch_sp` by their median steps).

Expected wire bytes per step and rank, n = tp, X = b·s·d·4 bytes, L layers (`facts`): without
SP, 4L + 2 all-reduces of X (attention and MLP f/g forward and backward, the embedding's g, the
head's f) plus the loss's 2 all-reduces of 3·b·s·4 bytes, each all-reduce 2(n−1)/n of its size;
with SP, 4L + 2 all-gathers and as many reduce-scatters of X, (n−1)/n · X each, plus the loss's
all-reduces and one all-reduce of d·4 bytes per norm (2L + 1) for the replicated gradients. Ours is
counted by `ctx.comm`, all four are measured on the loopback interface.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, llama_workload, run_contest, training_step
from ndtrain.config import ModelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import Llama, build_model
from ndtrain.parallel.model.tp_plan import parallelize

LR = 3e-4


def analytic_wire_bytes(model: ModelConfig, tokens: int, n: int, sequence_parallel: bool) -> int:
    """Wire bytes per rank of one training step (see the module docstring); `tokens` = b·s."""
    layers, x = model.n_layers, tokens * model.dim * 4
    kv_replicated = model.n_kv_heads % n != 0
    kv = 2 * layers * model.n_kv_heads * (model.dim // model.n_heads) * model.dim * 4 if kv_replicated else 0
    all_reduce = 3 * tokens * 4 + kv  # the loss, replicated kv-head gradients
    if not sequence_parallel:
        return 2 * (n - 1) * ((4 * layers + 2) * x + all_reduce) // n
    moves = 2 * (n - 1) * (4 * layers + 2) * x // n
    return moves + 2 * (n - 1) * (all_reduce + (2 * layers + 1) * model.dim * 4) // n


def _dtensor_plan(model: Llama, sequence_parallel: bool) -> dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        plan.update({
            f"{block}.attention.wq": ColwiseParallel(), f"{block}.attention.wk": ColwiseParallel(),
            f"{block}.attention.wv": ColwiseParallel(), f"{block}.attention.wo": RowwiseParallel(output_layouts=stream),
            f"{block}.feed_forward.w1": ColwiseParallel(), f"{block}.feed_forward.w3": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=stream),
        })
        if sp:
            plan.update({
                f"{block}.attention_norm": SequenceParallel(), f"{block}.ffn_norm": SequenceParallel(),
                f"{block}.attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
                f"{block}.feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    group = ctx.group("tp")
    if group.size < 2:
        raise UserError("bench tp compares tensor parallelism: run it with --nproc >= 2")
    work = llama_workload(ctx, options)
    shape = tuple(work.tokens.shape)
    generator = torch.Generator().manual_seed(options.seed)  # one stream: the tp ranks share the batch
    work = replace(work, tokens=torch.randint(0, work.model.vocab_size, shape, generator=generator).to(ctx.device))
    if options.seq_len % group.size:
        raise UserError(
            f"bench tp: --seq-len {options.seq_len} must be a multiple of --nproc {group.size} (sequence parallel)")

    def ours(sp: bool) -> Step:
        model = parallelize(build_model(work.model, options.seed, ctx.device), ctx, sequence_parallel=sp)
        return training_step(model, torch.optim.AdamW(model.parameters(), lr=LR), work.tokens)

    def dtensor(sp: bool) -> Step:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        mesh = DeviceMesh.from_group(group.process_group, device_type=ctx.device.type)
        model = build_model(work.model, options.seed, ctx.device)
        parallelize_module(model, mesh, _dtensor_plan(model, sp))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        tokens = work.tokens

        def step(i: int) -> None:
            with loss_parallel():
                model(tokens[i, :, :-1], tokens[i, :, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    n = group.size
    tokens = options.micro_batch * options.seq_len
    facts = {
        "preset": options.preset, "tp": n, "parameters": work.parameters,
        "tokens_per_step": tokens,
        "analytic_bytes": analytic_wire_bytes(work.model, tokens, n, False),
        "analytic_sp_bytes": analytic_wire_bytes(work.model, tokens, n, True),
    }
    contestants = [
        Contestant("ours", lambda: ours(False), counted=True),
        Contestant("ours_sp", lambda: ours(True), counted=True),
        Contestant("torch", lambda: dtensor(False), counted=False),
        Contestant("torch_sp", lambda: dtensor(True), counted=False),
    ]
    return run_contest(ctx, "tp", contestants, options, reference="torch", facts=facts)
