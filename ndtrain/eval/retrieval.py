"""Retrieval evaluation: a query set searched against a disjoint gallery, scored by mAP and CMC.

Metrics (`retrieval_metrics`), computed exactly and deterministically:
- Similarity is the cosine of the two embeddings, in float64 (each embedding divided by its L2
  norm in float64; a zero embedding stays zero, so its similarities are all 0). The gallery is
  ranked per query by descending similarity; ties are broken by gallery index, lower first (a
  stable sort), so the ranking and every metric depend only on the embeddings and their order.
- A gallery item is relevant to a query when their labels are equal. Query and gallery are
  disjoint sets, so nothing is excluded from the gallery.
- AP of one query: the mean over its relevant gallery items of the precision at that item's rank
  (hits up to and including it / its rank). mAP: the mean AP over queries.
- CMC rank-k: the fraction of queries whose first relevant item is among the top k.
- A query with no relevant gallery item has no AP and no first match: it is left out of both
  means and counted in `queries_without_match` (the Market-1501 rule); if every query is such,
  the metrics are nan.

Distributed (`evaluate_retrieval`): the ranks of one group (the data-parallel axis) each embed a
contiguous, possibly uneven shard of the query set and of the gallery (`data.sampler.eval_shard`:
no padding, no sample twice), gather embeddings, labels and sample indices with
`Communicator.all_gather_uneven` (per set: 2 collectives each for the three tensors; bytes ≈ the
set's embeddings, 8 bytes per label and index, plus padding to the largest shard), check that
every index arrives exactly once, and compute the metrics on every rank, from the same gathered
tensors in the same global order: the result equals the single-process result exactly whenever
the embeddings are the same.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from ndtrain.data.sampler import eval_shard
from ndtrain.dist.mesh import ParallelContext

DEFAULT_RANKS = (1, 5)


class LabeledSet(NamedTuple):
    """Samples (dim 0 indexes them) and their integer labels [n]."""

    inputs: torch.Tensor
    labels: torch.Tensor


def cosine_similarity(query: torch.Tensor, gallery: torch.Tensor) -> torch.Tensor:
    """[q, g] cosine similarities in float64."""
    q, g = query.double(), gallery.double()
    q = q / q.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    g = g / g.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return q @ g.T


def retrieval_metrics(
    query: torch.Tensor, query_labels: torch.Tensor, gallery: torch.Tensor, gallery_labels: torch.Tensor,
    ranks: Sequence[int] = DEFAULT_RANKS,
) -> dict[str, float]:
    """{"map", "cmc<k>" for k in `ranks`, "queries", "queries_without_match"} for [q, D] query and
    [g, D] gallery embeddings with labels [q] and [g] (rules in the module docstring)."""
    if any(k < 1 for k in ranks):
        raise ValueError(f"CMC ranks must be >= 1, got {list(ranks)}")
    similarity = cosine_similarity(query, gallery)
    order = torch.sort(similarity, dim=1, descending=True, stable=True).indices
    hits = gallery_labels.to(order.device)[order] == query_labels.to(order.device)[:, None]  # [q, g] in rank order
    relevant = hits.sum(dim=1)
    matched = relevant > 0
    positions = torch.arange(1, hits.shape[1] + 1, dtype=torch.float64)
    precision = hits.double().cumsum(dim=1) / positions
    ap = (precision * hits).sum(dim=1)[matched] / relevant[matched].double()
    first = hits[matched].double().argmax(dim=1)  # 0-based rank of the first relevant item
    valid = int(matched.sum())
    result = {"map": ap.sum().item() / valid if valid else math.nan}
    for k in ranks:
        result[f"cmc{k}"] = (first < k).sum().item() / valid if valid else math.nan
    result["queries"] = int(query.shape[0])
    result["queries_without_match"] = int(query.shape[0]) - valid
    return result


@torch.no_grad()
def _embed_shard(
    embed: Callable[[torch.Tensor], torch.Tensor], data: LabeledSet, ctx: ParallelContext, group: str, batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (embeddings, labels, indices) of `data`, gathered from every rank in index order.

    Every rank calls `embed` the same number of times (the largest shard's batch count, at least
    one; a rank past its shard passes an empty batch), so a model whose forward communicates
    (ZeRO-3 gathers parameters) runs in lockstep."""
    g = ctx.group(group)
    n = len(data.labels)
    shard = eval_shard(n, g.size, g.rank)
    longest = max(len(eval_shard(n, g.size, r)) for r in range(g.size))
    calls = max(1, math.ceil(longest / batch_size))
    pieces = []
    for i in range(calls):
        start = min(shard.start + i * batch_size, shard.stop)
        stop = min(start + batch_size, shard.stop)
        pieces.append(embed(data.inputs[start:stop].to(ctx.device)).detach())
    local = torch.cat(pieces)
    indices = torch.arange(shard.start, shard.stop, dtype=torch.int64, device=local.device)
    labels = data.labels[shard.start : shard.stop].to(device=local.device, dtype=torch.int64)
    embeddings = ctx.comm.all_gather_uneven(local, g)
    labels = ctx.comm.all_gather_uneven(labels, g)
    indices = ctx.comm.all_gather_uneven(indices, g)
    if not torch.equal(indices.cpu(), torch.arange(n)):
        raise RuntimeError(f"retrieval gather on {group!r}: expected each of {n} samples once, got {indices.numel()}")
    return embeddings, labels, indices


def evaluate_retrieval(
    embed: Callable[[torch.Tensor], torch.Tensor], query: LabeledSet, gallery: LabeledSet, ctx: ParallelContext, *,
    group: str = "dp", batch_size: int = 256, ranks: Sequence[int] = DEFAULT_RANKS,
) -> dict[str, float]:
    """mAP and CMC of `embed` (a batch of inputs [b, ...] → embeddings [b, D]) searching `gallery`
    with `query`, each rank of `ctx.group(group)` embedding its own shard; same result on every rank.

    Must be called by every rank of the group (it communicates). `embed` runs under no_grad in
    batches of at most `batch_size` on `ctx.device`; put the model in eval mode first."""
    q, q_labels, _ = _embed_shard(embed, query, ctx, group, batch_size)
    g, g_labels, _ = _embed_shard(embed, gallery, ctx, group, batch_size)
    return retrieval_metrics(q, q_labels, g, g_labels, ranks)
