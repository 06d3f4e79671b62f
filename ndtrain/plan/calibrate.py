"""`ndtrain plan --calibrate`: measure this machine into the CPU profile `hardware.load_profile` reads.

Measured, each in freshly spawned processes that all work at once (so shared cores show):
    matmul      fp32 and bf16 GFLOP/s per process, n = 1 and 2 processes (cores/n threads each):
                2·N³ FLOPs per N×N product, median over repeats
    memory      copy bandwidth per process, 2·bytes per copy (read + write)
    collectives gloo all-reduce, all-gather and send/recv on loopback for n = 2 and 4 processes
                (FileStore rendezvous in a temporary directory), at a small and a large message;
                α and B are fitted to the α–β ring formulas of `collectives.py`:
                    T = c_α·α + c_β·M/B,  (c_α, c_β) = (2(n−1), 2(n−1)/n) all-reduce,
                                                       ((n−1), (n−1)/n) all-gather, (1, 1) send/recv
                two sizes give two equations; B is "bus bandwidth" in the nccl-tests sense.
This is the one module of the planner that starts processes or touches torch.distributed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ndtrain.errors import UserError

MATMUL_N = 512
SMALL_BYTES = 4 * 1024
LARGE_BYTES = 8 * 1024**2
COPY_BYTES = 128 * 1024**2
REPEAT_S = 0.6  # time spent on each measurement
WORKER_TIMEOUT_S = 60.0


def _timed(fn: Callable[[], None], budget_s: float = REPEAT_S, min_reps: int = 3) -> float:
    """Median seconds of `fn` over repeats filling about `budget_s` (after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed_together(fn: Callable[[], None], dist: Any, budget_s: float) -> float:
    """Median seconds of `fn`, every rank running the same number of repeats (a collective hangs
    otherwise): the count comes from the slowest rank's first two calls."""
    import torch

    dist.barrier()
    fn()
    t0 = time.perf_counter()
    fn()
    fn()
    estimate = torch.tensor([(time.perf_counter() - t0) / 2])
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    reps = int(min(200, max(3, budget_s / max(estimate.item(), 1e-9))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_worker(rank: int, threads: int, barrier: Any, results: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    baseline = _rss_mib()
    rates: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype), torch.randn(MATMUL_N, MATMUL_N, dtype=dtype)
        barrier.wait()
        rates[name] = 2 * MATMUL_N**3 / _timed(lambda: torch.mm(a, b)) / 1e9
    src = torch.empty(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    barrier.wait()
    copy_gbs = 2 * COPY_BYTES / _timed(lambda: dst.copy_(src)) / 1e9
    results.put((rank, {"matmul": rates, "copy_gbs": copy_gbs, "baseline_mib": baseline}))


def _comm_worker(rank: int, world: int, store: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        timings: dict[str, dict[str, float]] = {}
        for label, nbytes in (("small", SMALL_BYTES), ("large", LARGE_BYTES)):
            full = torch.ones(nbytes // 4)
            part = torch.ones(nbytes // 4 // world)
            parts = [torch.empty_like(part) for _ in range(world)]

            def ping_pong() -> None:
                if rank == 0:
                    dist.send(full, 1)
                    dist.recv(full, 1)
                elif rank == 1:
                    dist.recv(full, 0)
                    dist.send(full, 0)

            ops = {
                "all_reduce": lambda: dist.all_reduce(full),
                "all_gather": lambda: dist.all_gather(parts, part),
                "send_recv": ping_pong,
            }
            for op, fn in ops.items():
                seconds = _timed_together(fn, dist, REPEAT_S / 2)
                timings.setdefault(op, {})[label] = seconds / 2 if op == "send_recv" else seconds
        results.put((rank, timings))
    finally:
        dist.destroy_process_group()


def _spawn(ctx: Any, target: Callable[..., None], args: list[tuple]) -> list[Any]:
    """Run `target(rank, *args[rank], results)` on one spawned process per rank; results by rank."""
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *rank_args, results), daemon=True)
             for rank, rank_args in enumerate(args)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    collected: dict[int, Any] = {}
    try:
        while len(collected) < len(procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"calibration workers did not finish within {WORKER_TIMEOUT_S:.0f} s")
            try:
                rank, value = results.get(timeout=0.5)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed and results.empty():
                    raise RuntimeError(f"a calibration worker failed (exit code {failed[0]}); see its traceback above")
                continue
            collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [collected[rank] for rank in range(len(procs))]


def _measure_compute(n: int, cores: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    return _spawn(ctx, _compute_worker, [(max(1, cores // n), barrier)] * n)


def _measure_comm(n: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="ndtrain-calibrate-") as tmp:
        store = os.path.join(tmp, "store")
        per_rank = _spawn(mp.get_context("spawn"), _comm_worker, [(n, store)] * n)
    return {op: {label: max(r[op][label] for r in per_rank) for label in per_rank[0][op]} for op in per_rank[0]}


def fit_alpha_beta(op: str, n: int, small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(α seconds, B bytes/s) from two (bytes, seconds) measurements of `op` on n ranks."""
    c_alpha, c_beta = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
                       "send_recv": (1, 1)}[op]
    (m_small, t_small), (m_large, t_large) = small, large
    slope = max((t_large - t_small) / (m_large - m_small), 1e-15)
    intercept = max(t_small - slope * m_small, 0.0)
    return intercept / c_alpha, c_beta / slope


def run(out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    profile: dict[str, Any] = {"kind": "ndtrain-cpu-profile", "version": 1, "cores": cores,
                               "matmul_gflops": {"fp32": {}, "bf16": {}}, "memory_gbs": {}, "collectives": {}}
    for n in (1, 2):
        per_rank = _measure_compute(n, cores)
        for dtype in ("fp32", "bf16"):
            profile["matmul_gflops"][dtype][str(n)] = round(statistics.median(r["matmul"][dtype] for r in per_rank), 3)
        profile["memory_gbs"][str(n)] = round(statistics.median(r["copy_gbs"] for r in per_rank), 3)
        profile["process_baseline_mib"] = round(max(r["baseline_mib"] for r in per_rank), 1)
    for n in (2, 4):
        measured = _measure_comm(n)
        for op, times in measured.items():
            alpha, bandwidth = fit_alpha_beta(op, n, (SMALL_BYTES, times["small"]), (LARGE_BYTES, times["large"]))
            profile["collectives"].setdefault(op, {})[str(n)] = {
                "latency_us": round(alpha * 1e6, 3), "bandwidth_gbs": round(bandwidth / 1e9, 4),
                "small_ms": round(times["small"] * 1e3, 4), "large_ms": round(times["large"] * 1e3, 4),
            }
    profile["memory_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 2)
    profile["seconds"] = round(time.perf_counter() - start, 1)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(profile, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"--out {out}: cannot write the profile ({e}); choose a writable path")
    return profile


def summary(profile: dict[str, Any]) -> str:
    lines = [f"calibrated in {profile['seconds']} s on {profile['cores']} cores"]
    for dtype, rates in profile["matmul_gflops"].items():
        lines.append(f"  matmul {dtype}: " + ", ".join(f"{n} proc {r:.1f} GFLOP/s each" for n, r in rates.items()))
    lines.append("  copy: " + ", ".join(f"{n} proc {r:.1f} GB/s each" for n, r in profile["memory_gbs"].items()))
    for op, fits in profile["collectives"].items():
        lines.append(f"  {op}: " + ", ".join(
            f"n={n} α={f['latency_us']:.0f} µs B={f['bandwidth_gbs']:.2f} GB/s" for n, f in fits.items()))
    return "\n".join(lines)


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
