"""Scenario `cp`: context parallel (ring attention) at cp = world size against one device per sequence.

Both contestants train the same Llama (same preset, seed and initial weights) with AdamW on the
same random token batches of `--seq-len` tokens (meant to be long: the point of cp), the same on
every rank, with the same loop: forward, backward, step, `zero_grad(set_to_none=True)`.
- `cpN` (N = world size; run `--nproc 2` and `--nproc 4` for cp = 2 and 4): our
  `DistributedDataParallel(apply_context_parallel(model))`; each rank holds 2 of the 2N load-balanced chunks
  of every sequence (`shard_sequence`), K/V travel around the ring, gradients are averaged over
  the cp group.
- `cp1`, the reference: every rank trains the whole sequence alone, with no communication, as the
  single-device job would. Running it on every rank at once keeps the machine as loaded as in
  the cpN runs (N busy processes, one core share each), so the step-time ratio cpN / cp1 is the
  speed-up of splitting one sequence over N devices, and each rank's peak memory is that of one
  device holding the whole sequence.

Facts reported besides the harness's step time, bytes and peak memory per rank:
- attention work per rank (score entries of one ring-attention forward, `attention_work`),
  balanced layout and, for comparison, the contiguous split: max/min ratios (1 and N);
- activation bytes saved for backward per rank (`SavedActivations`, deterministic), for cp1 and
  cpN, from one forward on the first batch; cpN holds (cp1 − 12)/N + 12 bytes (cross-entropy's
  fp32 total weight and the int64 target count dividing its sum do not scale with the sequence);
- wire bytes per step and rank, L layers, B batch, K kv heads, h head size, s = T/N, G gradient
  bytes: K/V ring L·(N−1)·2·B·K·s·h·4 forward + the same in backward, dK/dV L·N·2·B·K·s·h·4,
  plus the gradient all-reduce 2(N−1)/N·G; ours is counted by `ctx.comm`.
"""

from __future__ import annotations

import torch

from ndtrain.bench.harness import BenchOptions, Contestant, ContestResult, Step, llama_workload, run_contest
from ndtrain.config import ModelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.model.context import apply_context_parallel, attention_work, shard_sequence
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.model.recompute import SavedActivations

LR = 3e-4


def ring_wire_bytes(model: ModelConfig, batch: int, seq_len: int, cp: int) -> int:
    """Bytes each rank sends for ring attention in one training step (see the module docstring)."""
    block = 2 * batch * model.n_kv_heads * (seq_len // cp) * (model.dim // model.n_heads) * 4  # stacked K/V
    return model.n_layers * block * (2 * (cp - 1) + cp)


def run(ctx: ParallelContext, options: BenchOptions) -> ContestResult:
    cp = ctx.size("cp")
    if cp < 2:
        raise UserError("bench cp splits the sequence over the ranks: run it with --nproc >= 2")
    if options.seq_len % (2 * cp):
        raise UserError(f"bench cp: --seq-len {options.seq_len} must be a multiple of 2·cp = {2 * cp}")
    work = llama_workload(ctx, options)
    generator = torch.Generator().manual_seed(options.seed)  # one stream: the cp ranks share each sequence
    shape = (options.warmup + options.steps, options.micro_batch, options.seq_len + 1)
    tokens = torch.randint(0, work.model.vocab_size, shape, generator=generator).to(ctx.device)

    def single() -> Step:
        model = build_model(work.model, options.seed, ctx.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return _step(model, optimizer, lambda i: (tokens[i, :, :-1], tokens[i, :, 1:]))

    def ring() -> Step:
        model = DistributedDataParallel(apply_context_parallel(build_model(work.model, options.seed, ctx.device), ctx), ctx,
                             bucket_mb=options.bucket_mb)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return _step(model, optimizer, lambda i: shard_sequence(tokens[i, :, :-1], tokens[i, :, 1:], ctx))

    balanced = attention_work(options.seq_len, cp)
    contiguous = attention_work(options.seq_len, cp, balanced=False)
    ring_bytes = ring_wire_bytes(work.model, options.micro_batch, options.seq_len, cp)
    all_reduce_bytes = 2 * (cp - 1) * work.gradient_bytes // cp
    facts = {
        "preset": options.preset, "parameters": work.parameters, "seq_len": options.seq_len, "cp": cp,
        "attention_scores_per_rank": max(balanced),
        "work_max_over_min": max(balanced) / min(balanced),
        "contiguous_work_max_over_min": max(contiguous) / min(contiguous),
        "cp1_saved_activation_bytes": _saved_bytes(work.model, options, tokens, None),
        f"cp{cp}_saved_activation_bytes": _saved_bytes(work.model, options, tokens, ctx),
        "ring_bytes": ring_bytes, "all_reduce_bytes": all_reduce_bytes, "comm_bytes": ring_bytes + all_reduce_bytes,
    }
    contestants = [Contestant(f"cp{cp}", ring, counted=True), Contestant("cp1", single, counted=True)]
    return run_contest(ctx, "cp", contestants, options, reference="cp1", facts=facts)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> Step:
    def step(i: int) -> None:
        model(*batch(i)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _saved_bytes(cfg: ModelConfig, options: BenchOptions, tokens: torch.Tensor, ctx: ParallelContext | None) -> int:
    """Bytes saved for backward by one forward on the first batch: whole sequence, or this rank's shard."""
    model = build_model(cfg, options.seed, tokens.device)
    inputs, targets = tokens[0, :, :-1].clone(), tokens[0, :, 1:].clone()
    batch = (inputs, targets) if ctx is None else shard_sequence(inputs, targets, ctx)
    if ctx is not None:
        apply_context_parallel(model, ctx)
    with SavedActivations(model) as saved:
        model(*batch)
    return saved.bytes
