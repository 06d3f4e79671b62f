"""Cut a model into S = p·v pipeline stages and keep this rank's v of them.

What is split: the blocks, contiguously, into S stages (rank r holds stages r, r+p, …). A model
with a spec (`parallel.model_spec`: the built-in Llama's `LlamaStage`, a Hugging Face family's
`HFStage`; no model is imported here) names its blocks, what its first stage (embedding) and last
stage (norm, head, loss) add, and builds its stages; a `nn.Sequential` (or list of blocks) with a
`loss_fn` puts the loss on the last stage. Stages are cut from the full seeded model, so their
weights are the unsharded model's and parameter names are kept (`tok_embeddings.weight`,
`layers.5.attention.wq.weight`, `output.weight`).

Balance: the cut minimising the most expensive stage, by parameter count (`params`) or by the
measured forward+backward time of each piece (`measured`: every rank times every piece a few
times and the times are summed over the world with one all-reduce of L+2 numbers, so all ranks
cut alike). Tied embedding/head (`tie_embeddings=True`, p > 1): stage 0 and stage S−1 each hold
a copy; the runner sums their gradients (V·d elements sent each way per step) so both copies
take identical optimizer steps. The head's copy reports `is_pipeline_duplicate`, so a global
gradient norm counts the weight once. Memory per rank: its stages' parameters only (the full
model is built first; the caller drops it).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.model_spec import ModelParallel, parallel_spec
from ndtrain.config.options import PP_BALANCES, PipelineBalance
from ndtrain.parallel.placement import place, placement_or_whole

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_pipeline_duplicate(param: torch.Tensor) -> bool:
    """True on the copy of a tied weight (the head's) that a pipeline-wide sum must skip."""
    return placement_or_whole(param).pipeline_duplicate  # the cut places every duplicate it makes


class SequentialStage(nn.Module):
    """Some consecutive blocks of a sequential model; the last stage applies `loss_fn`."""

    def __init__(self, blocks: Sequence[nn.Module], block_ids: Sequence[int], loss_fn: LossFn | None) -> None:
        super().__init__()
        self.first = block_ids[0] == 0
        self.last = loss_fn is not None
        self.layers = nn.ModuleDict({str(i): blocks[i] for i in block_ids})
        self.loss_fn = loss_fn
        self.tied = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:
            raise UserError("context parallel with a pipeline of a sequential model is not supported (its blocks "
                            "take no positions): use cp=1, or the built-in Llama or a Hugging Face model")
        for block in self.layers.values():
            x = block(x)
        return self.loss_fn(x, targets) if self.loss_fn is not None else x


def balanced_split(costs: Sequence[float], parts: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Sizes of `parts` contiguous non-empty runs of `costs` minimising the largest run cost
    (run 0 also pays `first_extra`, the last run `last_extra`); on ties earlier runs are longer."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest max cost splitting costs[:j] into k runs; cut[k][j]: start of run k
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        extra = (first_extra if k == 1 else 0.0) + (last_extra if k == parts else 0.0)
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i] + extra)
                if value <= best[k][j] + 1e-12:  # on a tie the later cut: earlier runs take the extra
                    best[k][j], cut[k][j] = value, i
    sizes, j = [], n
    for k in range(parts, 0, -1):
        sizes.append(j - cut[k][j])
        j = cut[k][j]
    return sizes[::-1]


def split_model(
    model: nn.Module | Sequence[nn.Module], ctx: ParallelContext, *, virtual: int = 1,
    balance: PipelineBalance = "params",
    loss_fn: LossFn | None = None, sample: torch.Tensor | None = None,
) -> list[nn.Module]:
    """This rank's `virtual` stage modules (chunk order), cut from the full `model`.

    `model`: a model with a spec (its own loss: the built-in Llama, an HF causal LM), or an
    `nn.Sequential` / list of blocks with `loss_fn` (and, for `balance="measured"`, a `sample` input batch)."""
    p, rank = ctx.size("pp"), ctx.coord("pp")
    stages = p * virtual
    if virtual < 1:
        raise UserError(f"pipeline virtual stages must be >= 1, got {virtual}")
    if balance not in PP_BALANCES:
        raise UserError(f"pipeline balance {balance!r} is unknown: use {' or '.join(map(repr, PP_BALANCES))}")
    spec = parallel_spec(model)
    if spec is None and loss_fn is None:
        raise UserError("splitting a sequential model needs loss_fn=(output, targets) -> loss")
    blocks = spec.pipeline_blocks(loss_fn, balance) if spec is not None else list(model)
    if len(blocks) < stages:
        raise UserError(
            f"{len(blocks)} layers cannot fill {stages} pipeline stages (pp={p} × virtual={virtual}): "
            "use more layers or fewer stages"
        )
    if balance == "params":
        costs = [float(sum(t.numel() for t in b.parameters())) for b in blocks]
        first, last = spec.end_costs() if spec is not None else (0.0, 0.0)
    else:
        costs, first, last = _measured_costs(spec, blocks, sample, ctx)
    sizes = balanced_split(costs, stages, first, last)
    starts = [sum(sizes[:s]) for s in range(stages)]
    tied = spec.tied_weights() if spec is not None and p > 1 else None  # one rank holds both: autograd sums them
    out: list[nn.Module] = []
    for chunk in range(virtual):
        s = chunk * p + rank
        ids = range(starts[s], starts[s] + sizes[s])
        is_first, is_last = s == 0, s == stages - 1
        if spec is None:
            out.append(SequentialStage(blocks, ids, loss_fn if is_last else None))
            continue
        stage = spec.pipeline_stage(ids, first=is_first, last=is_last, loss_fn=loss_fn)
        if tied is not None and (is_first or is_last):  # one copy per end; the runner sums their gradients
            embedding, head = tied
            stage.tied = embedding if is_first else head
            if is_last:
                place(stage.get_parameter(head), pipeline_duplicate=True, replace=True)  # the engine named it
        out.append(stage)
    return out


def _measured_costs(
    spec: ModelParallel | None, blocks: list[nn.Module], sample: torch.Tensor | None, ctx: ParallelContext,
    repeats: int = 3,
) -> tuple[list[float], float, float]:
    """Forward+backward seconds of every block, and of the first and last stage's extras (a model with
    a spec times them itself), summed over the world so every rank cuts alike."""
    if spec is None and sample is None:
        raise UserError("balance='measured' on a sequential model needs sample=<an input batch>")
    device = next(iter(blocks[0].parameters())).device

    def timed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
        seconds = []
        for _ in range(repeats):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            fn(x_in).float().sum().backward()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    if spec is not None:
        costs, first, last = spec.measured_costs(blocks, timed)
    else:
        costs, x, first, last = [], sample, 0.0, 0.0
        for block in blocks:
            costs.append(timed(block, x))
            with torch.no_grad():
                x = block(x)
            block.zero_grad(set_to_none=True)
    totals = torch.tensor([first, last, *costs], dtype=torch.float64, device=device)
    ctx.comm.all_reduce(totals, ctx.group("world"))
    return totals[2:].tolist(), float(totals[0]), float(totals[1])
