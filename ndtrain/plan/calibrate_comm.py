"""The collectives part of a CPU profile: what a collective costs while the processes also compute.

Training processes alternate compute and collectives, and on a CPU both run on the same cores:
with more processes than cores a collective also waits until its peers are scheduled. So the
cost is measured the way training incurs it. P processes (gloo over loopback, FileStore
rendezvous, one intra-op thread each as `ndtrain train` sets) split into P/n groups of n
consecutive ranks, all groups at once; every rank repeats
    compute chunk (`CHUNK_PRODUCTS` fp32 products of two 512×512 matrices)  then  one collective
and, alternately, the chunk alone. The collective's cost is the difference of the two loops'
time per repetition (slowest rank), the median of `ROUNDS` alternations. Ops: all_reduce,
all_gather (into one tensor), reduce_scatter (from one tensor) of M bytes, and send_recv (a
ping-pong within pairs: half the round's cost), at 32 KiB, 512 KiB and 16 MiB, fitted (least
squares in relative error) to α and B of the α–β ring formulas
`T = c_α·α + c_β·M/B`, (c_α, c_β) = (2(n−1), 2(n−1)/n) all-reduce, ((n−1), (n−1)/n) all-gather
and reduce-scatter, (1, 1) send/recv (Thakur 2005): B is "bus bandwidth" in the nccl-tests sense.
The chunk's own time in the "alone" loops is kept too ("chunk_ms"): with more processes than
cores, its ratio to the time at one process per core, divided by the ideal P/S, is what sharing
the cores costs beyond splitting them (context switches, caches): `cpu_profile.CpuProfile.sharing`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

SIZES = (32 * 1024, 512 * 1024, 16 * 1024**2)  # bytes per collective
REPS = {SIZES[0]: 30, SIZES[1]: 30, SIZES[2]: 8}  # repetitions per loop
CHUNK_PRODUCTS = 2
ROUNDS = 7
COEFFICIENTS = {"all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
                "all_gather": lambda n: (n - 1, (n - 1) / n),
                "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
                "send_recv": lambda n: (1, 1)}


def group_sizes(processes: int) -> list[int]:
    return [n for n in (2, 4, 8) if n <= processes and processes % n == 0]


def fit_alpha_beta(op: str, n: int, points: list[tuple[float, float]]) -> tuple[float, float]:
    """(α seconds, B bytes/s) of `op` on n ranks from (bytes, seconds) measurements: the least-squares
    fit of T = c_α·α + c_β·M/B in relative error (each point weighted 1/T², so the small messages'
    latency counts as much as the large ones' bandwidth); α ≥ 0 and B > 0."""
    c_alpha, c_beta = COEFFICIENTS[op](n)
    weights = [1 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(weights)
    mean_m = sum(w * m for w, (m, _) in zip(weights, points)) / sw
    mean_t = sum(w * t for w, (_, t) in zip(weights, points)) / sw
    spread = sum(w * (m - mean_m) ** 2 for w, (m, _) in zip(weights, points))
    slope = sum(w * (m - mean_m) * (t - mean_t) for w, (m, t) in zip(weights, points)) / spread
    slope = max(slope, 1e-15)
    intercept = max(mean_t - slope * mean_m, 0.0)
    return intercept / c_alpha, c_beta / slope


def worker(rank: int, world: int, store: str, results: Any) -> None:
    """One of the P processes: every (op, n, size) cost in seconds, as {op: {n: {size: s}}}, and the
    median seconds of one compute chunk while all P processes compute (the "alone" loops)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def chunk() -> None:
            for _ in range(CHUNK_PRODUCTS):
                torch.mm(a, b)

        costs: dict[str, dict[int, dict[int, float]]] = {}
        chunks: list[float] = []
        for n in group_sizes(world):
            groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
            group, first = groups[rank // n], rank - rank % n
            for nbytes in SIZES:
                for op, fn in _ops(dist, torch, group, rank - first, first, n, nbytes).items():
                    rounds = []
                    for _ in range(ROUNDS):
                        alone = _loop(dist, torch, chunk, None, REPS[nbytes])
                        chunks.append(alone)
                        both = _loop(dist, torch, chunk, fn, REPS[nbytes])
                        rounds.append(max(both - alone, 0.0) / (2 if op == "send_recv" else 1))
                    costs.setdefault(op, {}).setdefault(n, {})[nbytes] = statistics.median(rounds)
        results.put((rank, (costs, statistics.median(chunks))))
    finally:
        dist.destroy_process_group()


def _ops(dist: Any, torch: Any, group: Any, me: int, first: int, n: int, nbytes: int) -> dict[str, Callable[[], None]]:
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # as ndtrain.dist.comm calls them
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    full = torch.ones(nbytes // 4)
    shard = torch.ones(nbytes // 4 // n)
    ops: dict[str, Callable[[], None]] = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: all_gather(full[: shard.numel() * n], shard, group=group),
        "reduce_scatter": lambda: reduce_scatter(shard, full[: shard.numel() * n], group=group),
    }
    if n == 2:
        peer = first + 1 - me

        def ping_pong() -> None:
            if me == 0:
                dist.send(full, peer)
                dist.recv(full, peer)
            else:
                dist.recv(full, peer)
                dist.send(full, peer)

        ops["send_recv"] = ping_pong
    return ops


def _loop(dist: Any, torch: Any, chunk: Callable[[], None], collective: Callable[[], None] | None, reps: int) -> float:
    """Seconds per repetition of chunk (+ collective), the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        chunk()
        if collective is not None:
            collective()
    elapsed = torch.tensor([(time.perf_counter() - start) / reps])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def fits(costs: dict[str, dict[int, dict[int, float]]], chunk_s: float) -> dict[str, Any]:
    """The profile's entries for one process count: per op and group size, α (µs), B (GB/s) and the
    two measured costs (ms); and "chunk_ms", the compute chunk's time while all processes compute."""
    out: dict[str, Any] = {"chunk_ms": round(chunk_s * 1e3, 4)}
    for op, by_n in costs.items():
        for n, by_size in by_n.items():
            alpha, bandwidth = fit_alpha_beta(op, n, [(m, by_size[m]) for m in SIZES])
            out.setdefault(op, {})[str(n)] = {
                "latency_us": round(alpha * 1e6, 3), "bandwidth_gbs": round(bandwidth / 1e9, 4),
                "measured_ms": {str(m): round(by_size[m] * 1e3, 4) for m in SIZES},
            }
    return out
