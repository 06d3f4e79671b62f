"""Retrieval evaluation: a query set searched against a disjoint gallery, scored by mAP and CMC.

Metrics (`retrieval_metrics`) follow one documented rule, so they depend only on the embeddings and
their order: not on how many queries are scored together, a vector's position in the gallery, the
number of processes, the BLAS library or the device.
- Score (`similarity_scores`): each embedding x (any float dtype, taken in float64) is divided by
  its L2 norm ‖x‖ = sqrt(x₀² + x₁² + … + x_{D−1}²), the squares added one component at a time in
  index order in float64 (a zero embedding stays zero), and each component of the unit vector is
  rounded to a multiple of 2^-26 (`SCORE_BITS`; round half to even): the vector's integer *code*
  c = round(2^26 · x / ‖x‖). The score of (query, gallery item) is the integer dot product of their
  codes, a cosine in units of 2^-52. Every partial sum of that product is an integer below 2^53, so
  the float64 matrix product computes it exactly whatever its blocking or summation order: equal
  vectors get exactly equal scores, wherever they stand. Rounding to 2^-26 (1.5e-8) is below a
  float32 embedding's own resolution (6e-8 relative).
- Ranking: per query, the gallery by descending score; **equal scores rank the lower gallery index
  first**.
- A gallery item is relevant to a query when their labels are equal. Query and gallery are
  disjoint sets, so nothing is excluded from the gallery.
- AP of one query: its relevant items' precisions at their ranks (hits so far / rank, each a
  float64 quotient) summed exactly and rounded once (`math.fsum`), divided by the number of relevant
  items. mAP: the APs summed the same way, divided by their number. CMC rank-k: the number of
  queries whose first relevant item is among the top k, divided by the number of queries counted.
- A query with no relevant gallery item has no AP and no first match: it is left out of both
  means and counted in `queries_without_match` (the Market-1501 rule); if every query is such, or
  an embedding has a non-finite component, the metrics are nan.

Cost: codes O((q + g)·D) (D element-wise passes over each set), scores one float64 [b, g] × D
matrix product per batch of b ≤ `query_batch` queries, a stable sort of each [b, g] block, and
O(relevant items) Python arithmetic for AP and CMC.

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


SCORE_BITS = 26  # unit-vector components are rounded to multiples of 2**-SCORE_BITS
MAX_DIM = 2**20   # codes of at most this many components keep every partial sum of a score below 2**53


def unit_codes(x: torch.Tensor) -> torch.Tensor:
    """[n, D] integer codes (as float64) of embeddings [n, D]: round(2^26 · x / ‖x‖), ‖x‖ accumulated
    one component at a time in index order (module docstring). Row i depends on x[i] alone."""
    if x.shape[1] > MAX_DIM:
        raise ValueError(f"retrieval embeddings have {x.shape[1]} components, more than {MAX_DIM}")
    x = x.double()
    columns = x.T.contiguous()
    squares = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    for column in columns:
        squares = squares + column * column  # two roundings per step, never fused
    norm = squares.sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.round(x / norm[:, None] * 2.0**SCORE_BITS)


def similarity_scores(query_codes: torch.Tensor, gallery_codes: torch.Tensor) -> torch.Tensor:
    """[q, g] int64 scores: the exact dot products of `unit_codes` (a cosine in units of 2^-52)."""
    return (query_codes @ gallery_codes.T).long()


def _ranked_hits(scores: torch.Tensor, query_labels: torch.Tensor, gallery_labels: torch.Tensor) -> list[list[int]]:
    """Per query, the 1-based ranks of its relevant gallery items, in rank order."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # equal scores: lower index first
    hits = gallery_labels.to(order.device)[order] == query_labels.to(order.device)[:, None]
    rows, positions = hits.nonzero().cpu().T.tolist()
    out: list[list[int]] = [[] for _ in range(scores.shape[0])]
    for row, position in zip(rows, positions):
        out[row].append(position + 1)
    return out


def retrieval_metrics(
    query: torch.Tensor, query_labels: torch.Tensor, gallery: torch.Tensor, gallery_labels: torch.Tensor,
    ranks: Sequence[int] = DEFAULT_RANKS, query_batch: int = 1024,
) -> dict[str, float]:
    """{"map", "cmc<k>" for k in `ranks`, "queries", "queries_without_match"} for [q, D] query and
    [g, D] gallery embeddings with labels [q] and [g] (rules in the module docstring). Queries are
    scored `query_batch` at a time (memory: a [query_batch, g] block); the result does not depend on it."""
    if any(k < 1 for k in ranks):
        raise ValueError(f"CMC ranks must be >= 1, got {list(ranks)}")
    if query_batch < 1:
        raise ValueError(f"query_batch must be >= 1, got {query_batch}")
    n = int(query.shape[0])
    if not (torch.isfinite(query).all() and torch.isfinite(gallery).all()):
        return {"map": math.nan, **{f"cmc{k}": math.nan for k in ranks}, "queries": n, "queries_without_match": n}
    query_codes, gallery_codes = unit_codes(query), unit_codes(gallery)
    hit_ranks: list[list[int]] = []
    for start in range(0, n, query_batch):
        scores = similarity_scores(query_codes[start : start + query_batch], gallery_codes)
        hit_ranks += _ranked_hits(scores, query_labels[start : start + query_batch], gallery_labels)
    matched = [r for r in hit_ranks if r]
    aps = [math.fsum(found / rank for found, rank in enumerate(r, start=1)) / len(r) for r in matched]
    valid = len(matched)
    result = {"map": math.fsum(aps) / valid if valid else math.nan}
    for k in ranks:
        result[f"cmc{k}"] = sum(r[0] <= k for r in matched) / valid if valid else math.nan
    result["queries"] = n
    result["queries_without_match"] = n - valid
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
    group: str = "dp", batch_size: int = 256, ranks: Sequence[int] = DEFAULT_RANKS, query_batch: int = 1024,
) -> dict[str, float]:
    """mAP and CMC of `embed` (a batch of inputs [b, ...] → embeddings [b, D]) searching `gallery`
    with `query`, each rank of `ctx.group(group)` embedding its own shard; same result on every rank.

    Must be called by every rank of the group (it communicates). `embed` runs under no_grad in
    batches of at most `batch_size` on `ctx.device`; put the model in eval mode first. `query_batch`:
    as in `retrieval_metrics`."""
    q, q_labels, _ = _embed_shard(embed, query, ctx, group, batch_size)
    g, g_labels, _ = _embed_shard(embed, gallery, ctx, group, batch_size)
    return retrieval_metrics(q, q_labels, g, g_labels, ranks, query_batch)
