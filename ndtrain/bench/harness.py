"""Benchmark harness: alternating timed runs of named contestants on every rank of a world.

A scenario (ddp, later zero/tp/pp) names its contestants, ours and PyTorch's equivalent, each a
`build()` that makes a fresh model and optimizer and returns `step(i)`, one training step on
batch i. After one discarded one-step run of each (the process's one-time costs), the harness
runs them in turns, R repeats (order reversed on every other repeat so neither side always runs
first), each run W warmup steps then S timed steps:

- step time: wall time of each timed step, the slowest rank's (ranks synchronise anyway, and a
  step is only done when every rank is); the figure of merit is the median over all timed steps,
  reported as the ratio contestant / reference;
- counted comm bytes per step: the wire bytes `ctx.comm.stats` recorded during the timed steps
  (for contestants whose collectives go through our comm layer);
- loopback bytes per step and rank: the growth of the `lo` transmit counter of /proc/net/dev
  during the timed steps (all local ranks plus any other loopback traffic on the machine, such
  as the launcher's store heartbeats), divided by the world size: a real measurement of what the
  process group sent, to set against the counted and textbook volumes;
- spread: the lowest and highest of the per-run median step times; when the spreads of a
  contestant and the reference (or the `limit` contestant of the data-parallel benches, see
  `ndtrain.bench.limit`) overlap, the result carries a warning that the machine was too noisy
  to separate them (`noise_warnings`), and the ratio should not be read as a difference;
- peak memory per rank (`ndtrain.dist.memory`): the peak since the start of the run (model build
  included), and that peak minus the resident memory before the build (interpreter, libraries;
  freed memory is returned to the system first); medians over runs. On a CUDA device (a world
  on NCCL, `ndtrain bench --device cuda`) both are the caching allocator's: the peak is
  `torch.cuda.max_memory_allocated` since the run's `reset_peak_memory_stats`, the baseline
  `memory_allocated`; a timed step ends with `torch.cuda.synchronize`, so it includes the
  device's work; the loopback counter sees only what NCCL sends over sockets (not NVLink or
  shared memory). The resident set counts a page of shared memory in every process that maps it
  (ours' gradient slots on one CPU host, dist/host_slots.py: each rank maps (N−1)/N of the others'
  slots), so the summary also gives each rank's peak less what it counts of shared pages beyond
  its share (`peak_own_share_bytes`: peak − (RssShmem − Pss_Shmem) read after the timed steps,
  when every slot page has been touched; `ndtrain.dist.memory.shared_overcount_bytes`): the host
  holds the sum of those over the ranks, not the sum of the peaks.

Bookkeeping costs one barrier per phase and one all-reduce of (S + 4) numbers per rank per run,
outside the timed steps. Results are one JSON-ready dict and a printed table (rank 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ndtrain.config import MODEL_PRESETS, ModelConfig, config_from_dict
from ndtrain.errors import UserError
from ndtrain.dist.memory import current_bytes, peak_bytes, reset_peak, shared_overcount_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.flat_adamw import fused_adamw_factory

MB = 1024 * 1024
LIMIT = "limit"  # the no-communication contestant's name (ndtrain.bench.limit)
_NET_DEV = Path("/proc/net/dev")

Step = Callable[[int], None]


@dataclass
class BenchOptions:
    """What every scenario is run with (the command-line flags of `ndtrain bench`)."""

    steps: int = 20
    warmup: int = 3
    repeats: int = 5
    bucket_mb: float = 25.0
    micro_batch: int = 2
    seq_len: int = 256
    preset: str = "bench"
    seed: int = 0
    # scenario ddp's levers (README "DDP"): ours' first bucket, recorded bucket order, flat AdamW, overlapped
    # update; torch's fused AdamW (torch.optim.AdamW(fused=True)) for the torch contestant. flat_adamw and
    # torch_fused_adamw also serve zero1/zero2/zero3 (ours' and the limit's AdamW fused; torch's)
    first_bucket_mb: float = 1.0
    reorder_buckets: bool = False
    flat_adamw: bool = False
    overlap_optimizer: bool = False
    torch_fused_adamw: bool = False
    host_slots: bool = True  # ddp/zero1/zero2/zero3: ours communicates through shared memory on one host (dist/host_slots.py)
    memory_of: str = ""  # set by `ndtrain bench` itself: run only this contestant, once, for its memory (fresh_memory.py)

    def validate(self) -> None:
        for name in ("steps", "repeats", "micro_batch", "seq_len", "bucket_mb", "first_bucket_mb"):
            if getattr(self, name) <= 0:
                raise UserError(f"bench --{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UserError(f"bench --warmup must be >= 0, got {self.warmup}")
        if self.preset not in MODEL_PRESETS:
            raise UserError(f"bench --model {self.preset!r} is unknown: choose one of {', '.join(MODEL_PRESETS)}")
        if self.overlap_optimizer and not self.flat_adamw:
            raise UserError("bench --overlap-optimizer overlaps the flat AdamW's bucket updates: add --flat-adamw")


@dataclass
class Workload:
    """What every contestant of a scenario trains: the model config, this rank's token batches
    ([warmup + steps, micro_batch, seq_len + 1], a stream per rank) and the model's sizes."""

    model: ModelConfig
    tokens: torch.Tensor
    parameters: int
    gradient_bytes: int


def llama_workload(ctx: ParallelContext, options: BenchOptions) -> Workload:
    model = config_from_dict({"model": {"preset": options.preset, "seq_len": options.seq_len}}).model
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + ctx.rank)
    shape = (options.warmup + options.steps, options.micro_batch, options.seq_len + 1)
    tokens = torch.randint(0, model.vocab_size, shape, generator=generator).to(ctx.device)
    parameters = model.parameter_count()  # by arithmetic: no extra copy of a 100 M model on every rank
    return Workload(model, tokens, parameters, 4 * parameters)  # every parameter is a trainable fp32 tensor


def adamw_factory(lr: float, fused: bool) -> Callable[[Any], torch.optim.Optimizer]:
    """torch's AdamW at `lr` over the parameters or groups it is given; `fused`: on torch's fused
    kernel, as `parallel.flat_adamw` makes it (`fused_adamw_factory`)."""

    def plain(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    return fused_adamw_factory(plain) if fused else plain


def levers(options: BenchOptions) -> str:
    """The lever flags a run was given, for its facts (`none` without any)."""
    names = ("reorder_buckets", "flat_adamw", "overlap_optimizer", "torch_fused_adamw")
    return ",".join(name for name in names if getattr(options, name)) or "none"


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Step:
    """step(i): forward, backward, optimizer step and zero_grad(set_to_none=True) on batch i."""

    def step(i: int) -> None:
        model(tokens[i, :, :-1], tokens[i, :, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@dataclass
class Contestant:
    name: str
    build: Callable[[], Step]
    counted: bool  # its collectives go through ctx.comm, so its bytes are counted


@dataclass
class RunRecord:
    step_s: list[float]  # per timed step, the slowest rank
    comm_bytes_per_step: float | None  # counted wire bytes of this rank
    loopback_bytes_per_step: float | None  # per rank
    peak_bytes: list[int]  # per rank
    baseline_bytes: list[int]  # per rank, resident before the build
    shared_overcount_bytes: list[int]  # per rank, shared-memory pages counted beyond its share

    def over_baseline_bytes(self) -> list[int]:
        return [p - b for p, b in zip(self.peak_bytes, self.baseline_bytes)]

    def own_share_bytes(self) -> list[int]:
        return [p - s for p, s in zip(self.peak_bytes, self.shared_overcount_bytes)]


MEMORY_STEPS = 5  # timed steps of a `memory_of` run (after the warmup): enough for every contestant's peak


class MemoryMeasured(Exception):
    """Raised by `run_contest` in a `memory_of` run once its contestant's one run is done, so the
    scenario stops there (its other measurements belong to the timed launch; fresh_memory.py)."""

    def __init__(self, record: RunRecord) -> None:
        super().__init__("memory measured")
        self.record = record


@dataclass
class ContestResult:
    scenario: str
    world_size: int
    reference: str
    options: dict[str, Any]
    facts: dict[str, Any]
    runs: dict[str, list[RunRecord]] = field(default_factory=dict)
    device: str = "cpu"  # where the contestants ran: "cpu" or "cuda"

    def summary(self) -> dict[str, dict[str, Any]]:
        ref_median = statistics.median(s for r in self.runs[self.reference] for s in r.step_s)
        limit_median = statistics.median(s for r in self.runs[LIMIT] for s in r.step_s) if LIMIT in self.runs else None
        out = {}
        for name, runs in self.runs.items():
            median = statistics.median(s for r in runs for s in r.step_s)
            run_medians = [statistics.median(r.step_s) for r in runs]
            comm = [r.comm_bytes_per_step for r in runs if r.comm_bytes_per_step is not None]
            loop = [r.loopback_bytes_per_step for r in runs if r.loopback_bytes_per_step is not None]
            out[name] = {
                "median_step_s": median,
                "ratio": median / ref_median,
                "ratio_to_limit": None if limit_median is None else median / limit_median,
                "run_median_step_s": run_medians,
                "spread_step_s": [min(run_medians), max(run_medians)],
                "comm_bytes_per_step": statistics.median(comm) if comm else None,
                "loopback_bytes_per_step": statistics.median(loop) if loop else None,
                "peak_bytes": [_median_int(r.peak_bytes[k] for r in runs) for k in range(self.world_size)],
                "peak_over_baseline_bytes": [
                    _median_int(r.over_baseline_bytes()[k] for r in runs) for k in range(self.world_size)
                ],
                "peak_own_share_bytes": [
                    _median_int(r.own_share_bytes()[k] for r in runs) for k in range(self.world_size)
                ],
            }
        return out

    def noise_warnings(self) -> list[str]:
        """One line per contestant whose spread overlaps the reference's or the limit's."""
        spreads = {name: s["spread_step_s"] for name, s in self.summary().items()}
        return [
            f"too noisy to separate {name} from {other}: run medians {_ms_range(spreads[name])} vs "
            f"{_ms_range(spreads[other])} overlap"
            for name in spreads if name not in (self.reference, LIMIT)
            for other in (self.reference, LIMIT) if other in spreads and spreads_overlap(spreads[name], spreads[other])
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "world_size": self.world_size, "device": self.device,
            "reference": self.reference, "options": self.options, "facts": self.facts, "summary": self.summary(),
            "warnings": self.noise_warnings(),
            "runs": {name: [asdict(r) for r in runs] for name, runs in self.runs.items()},
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        facts = ", ".join(f"{k}={_fmt_fact(k, v)}" for k, v in self.facts.items())
        lines = [
            f"{self.scenario} on {self.world_size} ranks — {facts}",
            f"{'contestant':<12}{'median step':>13}{'spread (run medians)':>22}{'ratio':>8}{'/limit':>8}"
            f"{'counted/step':>14}{'loopback/step':>15}"
            f"{'peak/rank':>11}{'over base':>11}{'own share':>11}",
        ]
        for name, s in self.summary().items():
            lines.append(
                f"{name:<12}{s['median_step_s'] * 1e3:>10.1f} ms{_ms_range(s['spread_step_s']):>22}{s['ratio']:>8.3f}"
                f"{'-' if s['ratio_to_limit'] is None else format(s['ratio_to_limit'], '.3f'):>8}"
                f"{_mb(s['comm_bytes_per_step']):>14}{_mb(s['loopback_bytes_per_step']):>15}"
                f"{max(s['peak_bytes']) / MB:>8.0f} MB{max(s['peak_over_baseline_bytes']) / MB:>8.0f} MB"
                f"{max(s['peak_own_share_bytes']) / MB:>8.0f} MB"
            )
        lines.append(
            f"ratio = median step / median step of {self.reference}; /limit = median step / median step of "
            f"{LIMIT} (no communication); spread = min–max of the per-run medians; bytes per rank; peaks: "
            "median over runs of the largest rank; own share = peak less the shared-memory pages it counts "
            "beyond its share; MB = 2^20 bytes"
        )
        lines.extend(f"warning: {w}" for w in self.noise_warnings())
        return "\n".join(lines)


def spreads_overlap(a: list[float], b: list[float]) -> bool:
    """Whether two [lowest, highest] ranges of run medians share a point: the runs cannot tell them apart."""
    return a[0] <= b[1] and b[0] <= a[1]


def run_contest(
    ctx: ParallelContext, scenario: str, contestants: list[Contestant], options: BenchOptions,
    *, reference: str, facts: dict[str, Any],
) -> ContestResult:
    """Every rank calls this with the same contestants; every rank gets the same result. With
    `options.memory_of`, it runs that contestant once (warmup + at most `MEMORY_STEPS` steps) and
    raises `MemoryMeasured` with the run (fresh_memory.py)."""
    if options.memory_of:
        chosen = [c for c in contestants if c.name == options.memory_of]
        if not chosen:
            raise UserError(f"bench --memory-of {options.memory_of!r}: the contestants are {[c.name for c in contestants]}")
        raise MemoryMeasured(_timed_run(ctx, chosen[0], replace(options, steps=min(options.steps, MEMORY_STEPS))))
    result = ContestResult(scenario, ctx.world_size, reference, asdict(options), facts, device=ctx.device.type)
    result.runs = {c.name: [] for c in contestants}
    for contestant in contestants:  # discarded: one-time costs (lazy init, thread pools, heap growth)
        _timed_run(ctx, contestant, BenchOptions(steps=1, warmup=0))
    for repeat in range(options.repeats):
        for contestant in contestants if repeat % 2 == 0 else contestants[::-1]:
            result.runs[contestant.name].append(_timed_run(ctx, contestant, options))
    return result


def _timed_run(ctx: ParallelContext, contestant: Contestant, options: BenchOptions) -> RunRecord:
    world = ctx.group("world")
    _return_freed_memory()
    ctx.comm.barrier(world)
    baseline = current_bytes(ctx.device)
    reset_peak(ctx.device)
    step = contestant.build()
    for i in range(options.warmup):
        step(i)
    _synchronize(ctx.device)
    ctx.comm.barrier(world)
    wire_before, loop_before = ctx.comm.stats.total_wire_bytes(), loopback_tx_bytes()
    times = []
    for i in range(options.steps):
        start = time.perf_counter()
        step(options.warmup + i)
        _synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    wire = ctx.comm.stats.total_wire_bytes() - wire_before
    ctx.comm.barrier(world)
    loop_after = loopback_tx_bytes()
    peak = peak_bytes(ctx.device)
    shared = shared_overcount_bytes() if ctx.device.type == "cpu" else 0
    ctx.comm.barrier(world)  # before any rank frees its model: the shared pages are still mapped everywhere
    del step
    loop = -1.0 if loop_before is None or loop_after is None else float(loop_after - loop_before)
    per_rank = _gather(ctx, [*times, float(peak), float(baseline), float(shared), loop])
    loop_total = per_rank[0, -1].item()  # rank 0's reading, so that every rank reports the same
    return RunRecord(
        step_s=per_rank[:, : options.steps].max(dim=0).values.tolist(),
        comm_bytes_per_step=wire / options.steps if contestant.counted else None,
        loopback_bytes_per_step=None if loop_total < 0 else loop_total / options.steps / ctx.world_size,
        peak_bytes=[int(v) for v in per_rank[:, -4].tolist()],
        baseline_bytes=[int(v) for v in per_rank[:, -3].tolist()],
        shared_overcount_bytes=[int(v) for v in per_rank[:, -2].tolist()],
    )


def _gather(ctx: ParallelContext, values: list[float]) -> torch.Tensor:
    """[world, len(values)]: every rank's values (an all-reduce of a tensor zero but for our row)."""
    table = torch.zeros(ctx.world_size, len(values), dtype=torch.float64, device=ctx.device)
    table[ctx.rank] = torch.tensor(values, dtype=torch.float64)
    ctx.comm.all_reduce(table, ctx.group("world"))
    return table.cpu()


def loopback_tx_bytes() -> int | None:
    """Bytes sent on the loopback interface since boot (Linux), or None where unavailable."""
    try:
        for line in _NET_DEV.read_text().splitlines():
            name, sep, counters = line.partition(":")
            if sep and name.strip() == "lo":
                return int(counters.split()[8])
    except OSError:
        return None
    return None


def _return_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back (glibc), so each run's peak starts from its own floor."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_int(values: Iterable[int]) -> int:
    return int(statistics.median(values))


def _ms_range(spread: list[float]) -> str:
    return f"{spread[0] * 1e3:.1f}–{spread[1] * 1e3:.1f} ms"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.2f} MB"


def _fmt_fact(key: str, value: Any) -> str:
    if key == "parameters":
        return f"{value:,} ({value / 1e6:.1f} M)"
    return f"{value / MB:.2f} MB" if key.endswith("_bytes") else str(value)


def from_rank0(ctx: ParallelContext, value: int) -> int:
    """Rank 0's `value` on every rank, so that every rank reports the same facts."""
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    ctx.comm.broadcast(tensor, ctx.group("world"), src=0)
    return int(tensor.item())
