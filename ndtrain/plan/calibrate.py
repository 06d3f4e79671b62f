"""`ndtrain plan --calibrate`: measure this machine into the CPU profile `cpu_profile.load_profile` reads.

Measured, each in freshly spawned processes that all work at once (so shared cores show):
    matmul      fp32 and bf16 GFLOP/s per process, n = 1 and 2 processes (cores/n threads each):
                2·N³ FLOPs per N×N product, median over repeats
    memory      copy bandwidth per process, 2·bytes per copy (read + write)
    elementwise ndtrain's own layer ops (norms, rotary, SwiGLU product, residual adds) in GB/s of the
                bytes the eager kernel profile counts for them (calibrate_elementwise.py), per process
    baseline    resident set of each of 2 processes set up as `ndtrain train` workers before their model:
                ndtrain's worker modules imported (cli, trainer, engine, strategies), intra-op threads
                set, a gloo process group of 2 initialised; again with transformers' model classes
                imported as an `hf:` worker does (skipped when transformers is not installed)
    collectives for P = 2 and 4 processes (and --gpus N): each op in groups of n while the
                processes compute between collectives (calibrate_comm.py)
    layers      with --model/--arch: the model's block and ends, forward and backward, per tp shard
                and micro-batch size, and AdamW per element (calibrate_layers.py), for each thread
                count the planned process counts use, with one process per slot; for P > slots the
                mean time of a fixed run of blocks with all P at once, whose slowdown beyond P/slots
                is the model's `sharing` (throughput, so a mean over processes, not a median of calls)
This and its two workers' modules are the planner's only code that starts processes or touches
torch.distributed.
"""

from __future__ import annotations

import importlib.util
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
from ndtrain.plan import calibrate_comm, cpu_profile
from ndtrain.plan.arch import ModelSpec

MATMUL_N = 512
PROCESS_COUNTS = (1, 2, 4)  # planned local process counts profiled by default
COPY_BYTES = 128 * 1024**2
REPEAT_S = 0.6  # time spent on each measurement
LAYER_ROUNDS, LAYER_BUDGET_S = 3, 0.3  # the layer profile: rounds over every piece, time per piece and round
SHARING_REPS, SHARING_ROUNDS = 3, 3  # forward + backward of the block stack per process, alternations
WORKER_TIMEOUT_S = 300.0
WORKER_MODULES = ("ndtrain.cli.commands", "ndtrain.trainer")  # what `ndtrain train` loads in a worker
BASELINE_MODULES = {  # by worker kind (cpu_profile.worker_kind): an hf: worker also loads transformers' model classes
    "ndtrain": WORKER_MODULES,
    "hf": WORKER_MODULES + ("ndtrain.models.hf", "transformers.modeling_utils", "transformers.generation",
                            "transformers.models.auto.modeling_auto"),
}


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


def _compute_worker(rank: int, threads: int, barrier: Any, results: Any) -> None:
    import torch

    from ndtrain.plan import calibrate_elementwise

    torch.set_num_threads(threads)
    rates: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype), torch.randn(MATMUL_N, MATMUL_N, dtype=dtype)
        barrier.wait()
        rates[name] = 2 * MATMUL_N**3 / _timed(lambda: torch.mm(a, b)) / 1e9
    src = torch.empty(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    barrier.wait()
    copy_gbs = 2 * COPY_BYTES / _timed(lambda: dst.copy_(src)) / 1e9
    barrier.wait()
    elementwise_gbs = calibrate_elementwise.measure(_timed)
    results.put((rank, {"matmul": rates, "copy_gbs": copy_gbs, "elementwise_gbs": elementwise_gbs}))


def _baseline_worker(rank: int, world: int, threads: int, store: str, kind: str, results: Any) -> None:
    """The resident MiB of a process set up as an `ndtrain train` worker of `kind` before its model."""
    import torch
    import torch.distributed as dist

    for module in BASELINE_MODULES[kind]:
        importlib.import_module(module)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        dist.barrier()
        results.put((rank, _rss_mib()))
    finally:
        dist.destroy_process_group()


def _layers_worker(rank: int, threads: int, model: ModelSpec, tps: list[int], barrier: Any, results: Any) -> None:
    import torch

    from ndtrain.plan import calibrate_layers

    torch.set_num_threads(threads)
    barrier.wait()
    rounds = [calibrate_layers.measure(model, tps, lambda fn: _timed(fn, LAYER_BUDGET_S)) for _ in range(LAYER_ROUNDS)]
    results.put((rank, rounds))


def _sharing_worker(rank: int, threads: int, model: ModelSpec, barrier: Any, results: Any) -> None:
    import torch

    from ndtrain.plan.calibrate_layers import Shard

    torch.set_num_threads(threads)
    shard = Shard(model, 1, 1, model.layers)
    shard.stack().sum().backward()
    barrier.wait()
    start = time.perf_counter()
    for _ in range(SHARING_REPS):
        shard.stack().sum().backward()
    results.put((rank, time.perf_counter() - start))


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
                raise UserError(f"the calibration's workers did not finish within {WORKER_TIMEOUT_S:.0f} s: other "
                                "processes are most likely using this machine's cores, and a profile measured under "
                                "their load would misprice every layout; run `ndtrain plan --calibrate` again on a "
                                "quiet machine")
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
            if len(collected) < len(procs):  # failed or overran: nothing more to wait for
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [collected[rank] for rank in range(len(procs))]


def _measure_compute(n: int, cores: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    return _spawn(ctx, _compute_worker, [(max(1, cores // n), barrier)] * n)


def _measure_baselines(cores: int, world: int = 2) -> dict[str, float]:
    """MiB per worker kind: the largest resident set of `world` workers (kinds whose modules are not
    installed are left out)."""
    baselines = {}
    for kind, modules in BASELINE_MODULES.items():
        if any(importlib.util.find_spec(m.split(".")[0]) is None for m in modules):
            continue
        with tempfile.TemporaryDirectory(prefix="ndtrain-calibrate-") as tmp:
            store = os.path.join(tmp, "store")
            rss = _spawn(mp.get_context("spawn"), _baseline_worker,
                         [(world, cpu_profile.threads_for(cores, world), store, kind)] * world)
        baselines[kind] = round(max(rss), 1)
    return baselines


def _measure_comm(processes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ndtrain-calibrate-") as tmp:
        store = os.path.join(tmp, "store")
        per_rank = _spawn(mp.get_context("spawn"), calibrate_comm.worker, [(processes, store)] * processes)
    costs = per_rank[0][0]  # every cost is already the slowest rank's
    return calibrate_comm.fits(costs, max(chunk for _, chunk in per_rank))


def _measure_layers(model: ModelSpec, threads: int, concurrency: int, tps: list[int]) -> dict[str, dict[str, float]]:
    """The median over `concurrency` processes measuring at once and `LAYER_ROUNDS` rounds, entry by
    entry (a round measures every piece once, so a burst of interference spoils one round, not a piece)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(concurrency)
    rounds = [r for per_rank in _spawn(ctx, _layers_worker, [(threads, model, tps, barrier)] * concurrency)
              for r in per_rank]
    return {piece: {name: statistics.median(r[piece][name] for r in rounds) for name in rounds[0][piece]}
            for piece in rounds[0]}


def _measure_sharing(model: ModelSpec, threads: int, slots: int, processes: int) -> float:
    """(mean seconds of a fixed amount of block forward + backward when `processes` processes run it at
    once) / (the same with `slots` processes) / (processes / slots): the throughput lost to sharing the
    cores beyond splitting them; median of `SHARING_ROUNDS` alternations."""
    ctx = mp.get_context("spawn")
    ratios = []
    for _ in range(SHARING_ROUNDS):
        mean = {}
        for n in (slots, processes):
            barrier = ctx.Barrier(n)
            mean[n] = statistics.fmean(_spawn(ctx, _sharing_worker, [(threads, model, barrier)] * n))
        ratios.append(mean[processes] / mean[slots] / (processes / slots))
    return statistics.median(ratios)


def run(out: Path, model: ModelSpec | None = None, processes: tuple[int, ...] = PROCESS_COUNTS) -> dict[str, Any]:
    """Measure, write the profile to `out`, return it. `processes`: the local process counts to plan."""
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    tps = cpu_profile.profiled_tps(model, max(processes)) if model is not None else []
    profile: dict[str, Any] = {"kind": "ndtrain-cpu-profile", "version": cpu_profile.VERSION, "cores": cores,
                               "matmul_gflops": {"fp32": {}, "bf16": {}}, "memory_gbs": {}, "elementwise_gbs": {},
                               "collectives": {}, "models": {}}
    for n in (1, 2):
        per_rank = _measure_compute(n, cores)
        for dtype in ("fp32", "bf16"):
            profile["matmul_gflops"][dtype][str(n)] = round(statistics.median(r["matmul"][dtype] for r in per_rank), 3)
        profile["memory_gbs"][str(n)] = round(statistics.median(r["copy_gbs"] for r in per_rank), 3)
        profile["elementwise_gbs"][str(n)] = round(statistics.median(r["elementwise_gbs"] for r in per_rank), 3)
    profile["process_baseline_mib"] = _measure_baselines(cores)
    for p in sorted(set(processes)):
        if p > 1:
            profile["collectives"][str(p)] = _measure_comm(p)
    if model is not None:
        by_threads = profile["models"].setdefault(cpu_profile.model_key(model), {})
        for p in sorted(set(processes)):
            threads, slots = cpu_profile.threads_for(cores, p), cpu_profile.slots_for(cores, p)
            if str(threads) not in by_threads:
                by_threads[str(threads)] = _measure_layers(model, threads, min(p, slots), tps)
            if p > slots:  # what sharing the cores costs p processes beyond splitting them
                by_threads[str(threads)].setdefault("sharing", {})[str(p)] = round(
                    _measure_sharing(model, threads, slots, p), 4)
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
    lines.append("  worker baseline (resident before the model): " + ", ".join(
        f"{kind} {mib:.0f} MiB" for kind, mib in profile["process_baseline_mib"].items()))
    lines.append("  copy: " + ", ".join(f"{n} proc {r:.1f} GB/s each" for n, r in profile["memory_gbs"].items()))
    lines.append("  ndtrain's element-wise layer ops: " + ", ".join(
        f"{n} proc {r:.1f} GB/s each" for n, r in profile["elementwise_gbs"].items()))
    for p, ops in profile["collectives"].items():
        lines.append(f"  {p} processes computing: {ops['chunk_ms']:.2f} ms per compute chunk")
        for op, fits in ops.items():
            if op == "chunk_ms":
                continue
            lines.append(f"  {p} processes, {op}: " + ", ".join(
                f"groups of {n} α={f['latency_us']:.0f} µs B={f['bandwidth_gbs']:.2f} GB/s" for n, f in fits.items()))
    return "\n".join(lines + cpu_profile.describe(profile))


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
