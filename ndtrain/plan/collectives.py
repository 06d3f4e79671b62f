"""α–β cost of the collectives the strategies use, for n ranks over a link (α latency, B bandwidth).

Ring algorithms (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009, bandwidth-optimal
all-reduce), M the bytes of the full buffer on each rank:
    all-reduce      2(n−1)·α + 2·(n−1)/n · M/B
    reduce-scatter   (n−1)·α +   (n−1)/n · M/B
    all-gather       (n−1)·α +   (n−1)/n · M/B       (M = the gathered size)
    send/recv              α +           M/B
B is the per-rank bandwidth of the slowest link the ring crosses ("bus bandwidth" in the
nccl-tests convention), so the same B serves every ring collective.
"""

from __future__ import annotations

from ndtrain.plan.hardware import Link


def all_reduce(n: int, nbytes: float, link: Link) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter(n: int, nbytes: float, link: Link) -> float:
    if n == 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def all_gather(n: int, nbytes: float, link: Link) -> float:
    return reduce_scatter(n, nbytes, link)


def send_recv(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


def exposed(total: float, overlap_window: float, first_piece: float) -> float:
    """Communication left on the critical path when it runs behind `overlap_window` seconds of
    compute, except for one piece (the first gather or the last bucket) that nothing can hide."""
    if total == 0.0:
        return 0.0
    return max(min(first_piece, total), total - overlap_window)
