"""Vocabulary parallelism: the embedding table and the output head split by vocabulary rows over tp.

What is split: a vocabulary of V entries is padded with zero rows to V' (the next multiple of n,
the tp size); rank r holds rows [r·V'/n, (r+1)·V'/n) of the embedding table and of the output
head (a `ColumnParallelLinear` with `out_padded=V'`). Padding rows are never looked up (tokens
are < V) and their logits are masked to −∞ in the loss, so they never affect it (their
gradients stay zero).

The embedding keeps what the table it replaces does besides the look-up: a `padding_idx` row gets
no gradient (on the rank holding it), and a scaled embedding's `embed_scale` (Gemma's
`*TextScaledWordEmbedding`: the rows times √d) multiplies this rank's rows before the sum. Any
other `nn.Embedding` subclass is refused: its forward is unknown here.

What is communicated, and when (b·s tokens of width d on each rank):
- `VocabParallelEmbedding` forward: each rank looks up the tokens in its rows (zeros elsewhere),
  then the partial embeddings are summed: all-reduce of b·s·d (g), or with sequence parallelism
  reduce-scattered onto sequence shards (ḡ*, all-gather of the gradient in backward).
- `vocab_parallel_cross_entropy` forward: one all-reduce (max) of b·s logit maxima, one
  all-reduce (sum) of 2·b·s numbers (Σ exp and the target's logit, from the rank owning it);
  backward communicates nothing (softmax − one-hot on the local columns). Targets equal to −100
  (`IGNORE_INDEX`) add nothing to the loss or its gradient; the mean is over the others. The full b·s·V logits
  never exist on one rank: each holds b·s·V'/n of them.
- `VocabParallelCrossEntropy.correct` (evaluation's next-token accuracy, eval/token_metrics.py): the
  argmax over the whole vocabulary from the shards: one all-reduce (max) of the b·s local maxima, one
  all-reduce (min) of the b·s global indices holding that maximum (ties go to the lowest index, as
  `torch.argmax` on the whole logits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.errors import UserError
from ndtrain.parallel.precision import at_least_fp32
from ndtrain.parallel.placement import carry_placement
from ndtrain.parallel.target_mean import IGNORE_INDEX
from ndtrain.parallel.model.tensor import from_parallel, _slice


def padded_vocab(vocab_size: int, tp: int) -> int:
    """V', the smallest multiple of `tp` ≥ `vocab_size`."""
    return -(-vocab_size // tp) * tp


def embedding_scale(embedding: nn.Module) -> torch.Tensor | None:
    """The scale a scaled embedding multiplies its rows by (its `embed_scale` buffer), None for a plain
    `nn.Embedding`; UserError for an embedding whose forward does something else."""
    if type(embedding) is nn.Embedding:
        return None
    scale = getattr(embedding, "embed_scale", None)
    if isinstance(embedding, nn.Embedding) and isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    raise UserError(f"the embedding is a {type(embedding).__name__}, whose forward a vocab-parallel table cannot "
                    "reproduce (a plain or an embed_scale-scaled nn.Embedding only)")


class VocabParallelEmbedding(nn.Module):
    """This rank's V'/n rows of an embedding table (times its scale); output summed over tp (or reduce-scattered)."""

    def __init__(
        self, embedding: nn.Embedding, comm: Communicator, group: Group, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.comm, self.group, self.sequence_parallel = comm, group, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padded = padded_vocab(embedding.num_embeddings, group.size)
        weight, shard = _slice(embedding.weight, 0, group.rank, group.size, self.padded)
        self.weight = carry_placement(nn.Parameter(weight), embedding.weight, tp=shard)
        self.start, self.stop = shard.start, shard.start + shard.length
        pad = embedding.padding_idx
        self.padding_idx = pad - self.start if pad is not None and self.start <= pad < self.stop else None
        scale = embedding_scale(embedding)
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", None if scale is None else scale.detach().clone(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.stop)
        local = torch.where(outside, 0, tokens - self.start)
        x = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        return from_parallel(x, self.comm, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"rows [{self.start}, {self.stop}) of {self.num_embeddings} (padded {self.padded}), "
                f"dim={self.embedding_dim}, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int,
        comm: Communicator, group: Group,
    ) -> torch.Tensor:
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        logits = at_least_fp32(logits.flatten(0, -2)).clone()  # [N, v], worked on in place from here
        width = logits.shape[-1]
        real = vocab_size - start  # columns of this shard that are real vocabulary entries
        if real < width:
            logits[:, max(real, 0):] = float("-inf")
        maxima = logits.max(dim=-1).values
        comm.all_reduce(maxima, group, op=dist.ReduceOp.MAX)
        logits.sub_(maxima.unsqueeze(-1))
        targets = targets.flatten()
        counted = targets.ne(IGNORE_INDEX)
        local = targets - start
        mine = (local >= 0) & (local < width)  # never an ignored target: it is negative
        index = torch.where(mine, local, 0).unsqueeze(-1)
        target_logit = logits.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        logits.exp_()
        totals = torch.stack([logits.sum(dim=-1), target_logit])
        comm.all_reduce(totals, group)
        sum_exp, target_logit = totals
        logits.div_(sum_exp.unsqueeze(-1))  # now this shard's softmax
        weight = counted.to(logits.dtype) / counted.sum().clamp(min=1)  # 1/n on each target, 0 elsewhere
        ctx.save_for_backward(logits, index, mine, weight)
        return ((sum_exp.log() - target_logit) * weight).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, index, mine, weight = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_((grad * weight).unsqueeze(-1))
        return grad_logits.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None, None


class VocabParallelCrossEntropy:
    """The loss seam of a vocab-parallel head (`model.loss_fn`): this rank holds logit columns
    [start, start + v) of the padded vocabulary; columns ≥ `vocab_size` are padding."""

    def __init__(self, start: int, vocab_size: int, comm: Communicator, group: Group) -> None:
        self.start, self.vocab_size, self.comm, self.group = start, vocab_size, comm, group

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.start, self.vocab_size, self.comm, self.group)

    def correct(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """How many targets ≠ −100 equal the argmax over the whole vocabulary (ties: the lowest index);
        the same count on every tp rank."""
        logits = at_least_fp32(logits.detach().flatten(0, -2))
        real = self.vocab_size - self.start
        if real < logits.shape[-1]:
            logits = logits.clone()
            logits[:, max(real, 0):] = float("-inf")
        best, index = logits.max(dim=-1)  # the first of equal maxima: the lowest local index
        top = best.clone()
        self.comm.all_reduce(top, self.group, op=dist.ReduceOp.MAX)
        winner = torch.where(best == top, index + self.start, torch.iinfo(torch.int64).max)
        self.comm.all_reduce(winner, self.group, op=dist.ReduceOp.MIN)
        targets = targets.flatten()
        return ((winner == targets) & targets.ne(IGNORE_INDEX)).sum()


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, comm: Communicator, group: Group,
) -> torch.Tensor:
    """Mean cross-entropy (fp32) over the targets ≠ IGNORE_INDEX of `targets` [...] (0 when there are none) given this rank's logit columns
    [start, start + v) of the padded vocabulary (`logits` [..., v]); columns ≥ `vocab_size` are padding."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, vocab_size, comm, group)
