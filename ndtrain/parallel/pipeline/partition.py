"""Cut a model into S = p·v pipeline stages and keep this rank's v of them.

What is split: the blocks, contiguously, into S stages (rank r holds stages r, r+p, …). The
built-in Llama puts its embedding on stage 0 and final norm + head + loss on stage S−1; a
`nn.Sequential` (or list of blocks) with a `loss_fn` puts the loss on the last stage; a Hugging
Face causal LM of a known family is cut along its decoder-layer list (hf_stages.py). Stages are
cut from the full seeded model, so their weights are the unsharded model's and parameter names
are kept (`tok_embeddings.weight`, `layers.5.attention.wq.weight`, `output.weight`).

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

import functools
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.models.hf_families import FAMILIES, Family, family_of, hf_config
from ndtrain.models.llama import Llama
from ndtrain.parallel.pipeline.hf_stages import HFStage, end_costs
from ndtrain.parallel.placement import place, placement_of

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
def is_pipeline_duplicate(param: torch.Tensor) -> bool:
    """True on the copy of a tied weight (the head's) that a pipeline-wide sum must skip."""
    return placement_of(param).pipeline_duplicate


class LlamaStage(nn.Module):
    """Some blocks of a Llama, with its embedding (first stage) and/or norm, head, loss (last).

    Runs the model's own `rotary`, `embed` and `head` seams (and its `loss_fn`) on itself; a seam
    a strategy replaced on the model instance (tensor parallel's head, a partial bound to the
    model) is rebound to the stage, so a parallelized model splits the same way and the rest of
    the full model can be freed."""

    def __init__(self, model: Llama, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self._seams = type(model)
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.norm, self.output = model.norm, model.output
            self.loss_fn = model.loss_fn
        for name in ("rotary", "embed", "head"):
            seam = model.__dict__.get(name)
            if isinstance(seam, functools.partial) and seam.args and seam.args[0] is model:
                seam = functools.partial(seam.func, self, *seam.args[1:], **seam.keywords)
            if seam is not None:
                setattr(self, name, seam)
        self.tied = "tok_embeddings.weight" if first else "output.weight"
        self.tied = self.tied if model.cfg.tie_embeddings and first != last else None

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._seams.rotary(self, positions)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._seams.embed(self, tokens)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        return self._seams.head(self, x, targets)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens (first stage) or the activation [B, T or a sequence shard, d] → activation, or on
        the last stage the loss (the logits without targets). The sequence length is the targets'
        when given (activations may be sequence shards); `positions` [T/cp] are a context-parallel
        shard's global positions (default 0..T−1)."""
        seq = (x if targets is None else targets).shape[1]
        cos, sin = self.rotary(torch.arange(seq, device=x.device) if positions is None else positions)
        if self.first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.head(x, targets) if self.last else x


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
    model: nn.Module | Sequence[nn.Module], ctx: ParallelContext, *, virtual: int = 1, balance: str = "params",
    loss_fn: LossFn | None = None, sample: torch.Tensor | None = None,
) -> list[nn.Module]:
    """This rank's `virtual` stage modules (chunk order), cut from the full `model`.

    `model`: a `Llama` (its own loss), or an `nn.Sequential` / list of blocks with `loss_fn`
    (and, for `balance="measured"`, a `sample` input batch)."""
    p, rank = ctx.size("pp"), ctx.coord("pp")
    stages = p * virtual
    if virtual < 1:
        raise UserError(f"pipeline virtual stages must be >= 1, got {virtual}")
    if balance not in ("params", "measured"):
        raise UserError(f"pipeline balance {balance!r} is unknown: use 'params' or 'measured'")
    llama = isinstance(model, Llama)
    family = _hf_family(model, loss_fn, balance)
    if not llama and family is None and loss_fn is None:
        raise UserError("splitting a sequential model needs loss_fn=(output, targets) -> loss")
    blocks = list(model.layers) if llama else list(model.get_submodule(family.layers)) if family else list(model)
    if len(blocks) < stages:
        raise UserError(
            f"{len(blocks)} layers cannot fill {stages} pipeline stages (pp={p} × virtual={virtual}): "
            "use more layers or fewer stages"
        )
    if balance == "params":
        costs = [float(sum(t.numel() for t in b.parameters())) for b in blocks]
        first = float(model.tok_embeddings.weight.numel()) if llama else 0.0
        last = float(sum(t.numel() for m in (model.norm, model.output) for t in m.parameters())) if llama else 0.0
        if family is not None:
            first, last = end_costs(model, family)
    else:
        costs, first, last = _measured_costs(model, blocks, loss_fn, sample, ctx)
    sizes = balanced_split(costs, stages, first, last)
    starts = [sum(sizes[:s]) for s in range(stages)]
    out: list[nn.Module] = []
    for chunk in range(virtual):
        s = chunk * p + rank
        ids = range(starts[s], starts[s] + sizes[s])
        if llama:
            stage = LlamaStage(model, ids, first=s == 0, last=s == stages - 1)
            stage.tied = stage.tied if p > 1 else None  # one rank holds both: autograd sums them
            if stage.tied == "output.weight":
                place(stage.output.weight, pipeline_duplicate=True)
        elif family is not None:
            stage = HFStage(model, family, ids, first=s == 0, last=s == stages - 1, loss_fn=loss_fn)
            if p > 1 and family.tied and s in (0, stages - 1):  # one copy per end; the runner sums their gradients
                head, embedding = next(iter(family.tied.items()))
                stage.tied = embedding if s == 0 else head
                if s == stages - 1:
                    place(stage.get_parameter(head), pipeline_duplicate=True)
        else:
            stage = SequentialStage(blocks, ids, loss_fn if s == stages - 1 else None)
        out.append(stage)
    return out


def _hf_family(model: nn.Module | Sequence[nn.Module], loss_fn: LossFn | None, balance: str) -> Family | None:
    """The family spec of a Hugging Face model (None for any other model); one line when one cannot be cut."""
    config = hf_config(model) if isinstance(model, nn.Module) else None
    if config is None:
        return None
    family = family_of(model)  # type: ignore[arg-type]
    if family is None:
        raise UserError(
            f"pipeline parallel is not supported for Hugging Face model_type {config.model_type!r}: "
            f"supported families are {', '.join(FAMILIES)} (or pass the blocks as an nn.Sequential with loss_fn)"
        )
    if getattr(model, "hf", None) is None and loss_fn is None:
        raise UserError("splitting a bare Hugging Face model needs loss_fn=(output, targets) -> loss, "
                        "or wrap it in ndtrain.models.causal_lm.CausalLM")
    if balance == "measured":
        raise UserError("pipeline balance 'measured' is not supported for Hugging Face models: use 'params'")
    return family


def _measured_costs(
    model: nn.Module | Sequence[nn.Module], blocks: list[nn.Module], loss_fn: LossFn | None,
    sample: torch.Tensor | None, ctx: ParallelContext, repeats: int = 3,
) -> tuple[list[float], float, float]:
    """Forward+backward seconds of every block, and of the embedding and head (Llama), summed
    over the world so every rank cuts alike."""
    llama = isinstance(model, Llama)
    if not llama and sample is None:
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

    costs: list[float] = []
    if llama:
        tokens = torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device=device)
        first = timed(model.embed, tokens)
        x = model.embed(tokens).detach()
        cos, sin = model.rotary(torch.arange(tokens.shape[1], device=device))
        for block in blocks:
            costs.append(timed(lambda h, b=block: b(h, cos, sin), x))
        last = timed(lambda h: model.head(h, tokens), x)
    else:
        x, first, last = sample, 0.0, 0.0
        for block in blocks:
            costs.append(timed(block, x))
            with torch.no_grad():
                x = block(x)
    model.zero_grad(set_to_none=True) if llama else [b.zero_grad(set_to_none=True) for b in blocks]
    totals = torch.tensor([first, last, *costs], dtype=torch.float64, device=device)
    ctx.comm.all_reduce(totals, ctx.group("world"))
    return totals[2:].tolist(), float(totals[0]), float(totals[1])
