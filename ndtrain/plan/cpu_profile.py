"""A calibrated CPU profile (`ndtrain plan --calibrate`) as the planner's device: `load_profile`.

The profile plans P local processes on a machine of C cores, each process running
T = max(1, C // P) intra-op threads (what `ndtrain train`/`bench` set), so at most
S = C // T processes compute at once ("slots"). It holds, all measured on this machine:
    matmul_gflops, memory_gbs     per-process rates at 1 and 2 concurrent processes: the FLOP-based
                                  fallback for models without a layer profile
    elementwise_gbs               per-process rate of ndtrain's own element-wise layer ops, in bytes
                                  the eager kernel profile counts (calibrate_elementwise.py): η_ew of
                                  that fallback, relative to the copy rate (1 in older profiles)
    collectives[P][op][n]         α and B of all_reduce, all_gather, reduce_scatter and send_recv in
                                  groups of n ranks while all P processes exist and compute between
                                  collectives (see calibrate_comm.py), fitted to the α–β formulas
    collectives[P]["chunk_ms"]    a compute chunk's time while all P processes compute: its ratio to
                                  the time at S processes, over the ideal P/S, is the `sharing` factor
    models[key][T][tp mbs]        seconds of one Llama block, of the model's ends (embedding, norm,
                                  logits, loss) forward and backward on tp rank 0's shard at micro-batch
                                  mbs, the block's backward split as zero-bubble runs it (input pass I,
                                  weight passes W: split_backward.py), and AdamW seconds per element
                                  (calibrate_layers.py), measured with T threads in min(P, S) processes at once
    process_baseline_mib[kind]    resident set of a process set up as an `ndtrain train` worker before its
                                  model (its modules imported, a gloo process group of 2 initialised), for
                                  kind "ndtrain" (built-in models) and "hf" (also transformers' model
                                  classes): the memory planner's reserved bytes per rank
    models[key][T]["sharing"][P]  for P > S, a fixed run of the model's blocks with all P processes at
                                  once, its slowdown beyond P/S: the model's own `sharing` factor
                                  (preferred to the chunk's)
What the planner derives from it (timing.py): per-process compute from the model's measured pieces
(or FLOPs ÷ matmul rate), collectives from the fit for their op and group size, and — when P > S —
that the P processes share S slots, so a step takes at least sharing · (work of all processes) / S.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ndtrain.errors import UserError
from ndtrain.plan import jsonfile
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import measured
from ndtrain.plan.hardware import FP32, GB, GIB, Hardware, Link

VERSION = 4  # 4: the block's split backward (layer_i, layer_w); 3: process_baseline_mib per worker kind
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def model_key(model: ModelSpec) -> str:
    """The shapes a layer profile is valid for (the name does not matter, the sizes do)."""
    key = f"{model.arch} h{model.hidden} a{model.heads} k{model.kv_heads} f{model.ffn} V{model.vocab} s{model.seq}"
    if model.head_size is not None and model.head_size != model.hidden // model.heads:
        key += f" d{model.head_size}"
    if model.moe is not None:
        key += f" E{model.moe.count} top{model.moe.top_k} fe{model.moe.ffn} fs{model.moe.shared_ffn}"
    return key


def worker_kind(model: ModelSpec) -> str:
    """Which worker process runs the model: "hf" (transformers' modules) or "ndtrain" (its own layers)."""
    return "hf" if model.hf else "ndtrain"


def shard_key(tp: int, mbs: int) -> str:
    return f"tp{tp} mbs{mbs}"


def threads_for(cores: int, processes: int) -> int:
    return max(1, cores // processes)


def slots_for(cores: int, processes: int) -> int:
    """How many of `processes` processes (each with `threads_for` threads) can compute at once."""
    return max(1, cores // threads_for(cores, processes))


def _parse_shard_key(key: str) -> tuple[int, int]:
    tp, mbs = key.split()
    return int(tp.removeprefix("tp")), int(mbs.removeprefix("mbs"))


def profiled_tps(model: ModelSpec, max_processes: int) -> list[int]:
    """The tp degrees a layer profile covers: those dividing the query heads and `max_processes`."""
    if model.arch != "llama":
        raise UserError(f"--calibrate --model profiles llama models (ndtrain's family); {model.name} is "
                        f"{model.arch}: calibrate without --model (its compute is then estimated from FLOPs)")
    if model.moe is not None or model.head_size not in (None, model.hidden // model.heads):
        raise UserError(f"--calibrate --model profiles ndtrain's Llama block; {model.name} has experts or a head size "
                        "other than hidden/heads: calibrate without --model (its compute is then estimated from FLOPs)")
    return [t for t in range(1, max_processes + 1) if max_processes % t == 0 and model.heads % t == 0]


@dataclass(frozen=True)
class PieceTimes:
    """Seconds of one micro-batch through one block, and through the model's two ends, on one process;
    layer_i + layer_w: the block's backward split into zero-bubble's input pass and weight passes."""

    layer_f: float
    layer_b: float
    head_f: float
    head_b: float
    layer_i: float
    layer_w: float


@dataclass(frozen=True)
class CpuProfile:
    cores: int
    processes: int
    links: dict[tuple[str, int], Link]
    pieces: dict[str, dict[tuple[int, int], PieceTimes]] = field(default_factory=dict)  # model key -> (tp, mbs) -> times
    adamw_s_per_param: dict[str, float] = field(default_factory=dict)  # model key -> seconds
    sharing: float = 1.0  # ≥ 1: what P > S processes lose to sharing the cores beyond splitting them
    model_sharing: dict[str, float] = field(default_factory=dict)  # model key -> the same, for its layers
    baselines: dict[str, float] = field(default_factory=dict)  # worker kind ("ndtrain", "hf") -> resident bytes

    def baseline(self, model: ModelSpec) -> float:
        """Bytes a worker of this model's kind holds before its model: an `hf:` model's worker also
        holds transformers."""
        kind = worker_kind(model)
        if kind not in self.baselines:
            raise UserError(f"the CPU profile has no {kind} worker baseline (transformers was not installed when it "
                            "was calibrated): install transformers and run `ndtrain plan --calibrate` again")
        return self.baselines[kind]

    @property
    def threads(self) -> int:
        return threads_for(self.cores, self.processes)

    @property
    def slots(self) -> int:
        """How many of the processes can compute at the same time."""
        return slots_for(self.cores, self.processes)

    def link(self, op: str, n: int) -> Link:
        """The fit for `op` in groups of n (the nearest measured group size)."""
        sizes = [size for (o, size) in self.links if o == op]
        nearest = min(sizes, key=lambda size: (abs(size - n), -size))
        return self.links[(op, nearest)]

    def sharing_for(self, model: ModelSpec) -> float:
        """The slowdown beyond P/S of P processes sharing S slots: measured on the model's own layers
        when the profile has them, else on the calibration's matmul chunk."""
        return self.model_sharing.get(model_key(model), self.sharing)

    def piece_times(self, model: ModelSpec, tp: int, mbs: int) -> PieceTimes | None:
        """Measured pieces at (tp, mbs); another mbs is scaled from the nearest measured one (time ∝
        tokens); None when this model or tp was not profiled."""
        table = self.pieces.get(model_key(model), {})
        measured = {b: times for (shard_tp, b), times in table.items() if shard_tp == tp}
        if not measured:
            return None
        nearest = min(measured, key=lambda b: (abs(b - mbs), -b))
        t, scale = measured[nearest], mbs / nearest
        return PieceTimes(*(getattr(t, name) * scale for name in PieceTimes.__dataclass_fields__))


def load_profile(path: Path, processes: int) -> Hardware:
    """The "cpu" device of a calibrated profile, for `processes` local ranks sharing the machine."""
    data = jsonfile.read(path, "--profile", "an ndtrain CPU profile", "kind", "ndtrain-cpu-profile",
                         "write one with `ndtrain plan --calibrate`")
    if data.get("version") != VERSION:
        raise UserError(f"--profile {path} is a version {data.get('version')} profile; this planner reads version "
                        f"{VERSION}: run `ndtrain plan --calibrate` again")
    cores = int(data["cores"])
    threads = threads_for(cores, processes)
    comm = data["collectives"]
    measured_counts = sorted(int(p) for p in comm)
    nearest = str(min(measured_counts, key=lambda p: (abs(p - processes), -p)))
    links = {(op, int(n)): Link(fit["bandwidth_gbs"] * GB, fit["latency_us"] * 1e-6)
             for op, fits in comm[nearest].items() if op in OPS for n, fit in fits.items()}
    pieces: dict[str, dict[tuple[int, int], PieceTimes]] = {}
    adamw: dict[str, float] = {}
    model_sharing: dict[str, float] = {}
    for key, by_threads in data.get("models", {}).items():
        table = by_threads.get(str(threads))
        if table is None:
            continue
        adamw[key] = table["adamw"]["s_per_param"]
        pieces[key] = {_parse_shard_key(shard): PieceTimes(**t) for shard, t in table.items() if shard.startswith("tp")}
        if str(processes) in table.get("sharing", {}):
            model_sharing[key] = max(1.0, table["sharing"][str(processes)])
    baselines = {kind: mib * 1024**2 for kind, mib in data["process_baseline_mib"].items()}
    cpu = CpuProfile(cores, processes, links, pieces, adamw, _sharing(comm, nearest, cores, processes), model_sharing,
                     baselines)
    flops = _per_process(data["matmul_gflops"]["fp32"], processes) * GB
    memory_bw = _per_process(data["memory_gbs"], processes) * GB
    measured_ew = data.get("elementwise_gbs")  # absent from profiles written before it was measured
    elementwise = _per_process(measured_ew, processes) * GB / memory_bw if measured_ew else 1.0
    link = cpu.link("all_reduce", processes)
    ram = data["memory_total_gib"] * GIB / processes
    reserved = baselines["ndtrain"]
    return Hardware("cpu", "cpu", flops, measured(elementwise), ram, reserved, memory_bw, link, link, FP32, False, cpu)


def _sharing(comm: dict[str, Any], measured: str, cores: int, processes: int) -> float:
    """(compute chunk at P processes) / (chunk at one process per slot × P/S), at least 1; 1 when P ≤ S
    or the profile has no chunk at a count ≤ S to compare with."""
    slots = slots_for(cores, processes)
    below = [int(p) for p in comm if int(p) <= slots and "chunk_ms" in comm[p]]
    if processes <= slots or not below or "chunk_ms" not in comm[measured]:
        return 1.0
    reference = comm[str(max(below))]["chunk_ms"]
    return max(1.0, comm[measured]["chunk_ms"] / (reference * int(measured) / slots))


def _per_process(rates: dict[str, float], processes: int) -> float:
    """The measured per-process rate at this concurrency; beyond the measured counts, the machine's
    best total rate shared evenly (more processes than cores only split the same cores)."""
    if str(processes) in rates:
        return rates[str(processes)]
    best_total = max(int(n) * rate for n, rate in rates.items())
    below = [int(n) for n in rates if int(n) < processes]
    return min(best_total / processes, rates[str(max(below))]) if below else rates[min(rates, key=int)]


def describe(data: dict[str, Any]) -> list[str]:
    """Lines summarising the layer profiles of a profile's JSON (for `--calibrate`'s printout)."""
    lines = []
    for key, by_threads in data.get("models", {}).items():
        for threads, table in by_threads.items():
            shards = ", ".join(f"{shard}: block {t['layer_f'] * 1e3:.1f}+{t['layer_b'] * 1e3:.1f} ms (split "
                               f"{t['layer_i'] * 1e3:.1f}+{t['layer_w'] * 1e3:.1f} ms), ends "
                               f"{t['head_f'] * 1e3:.1f}+{t['head_b'] * 1e3:.1f} ms"
                               for shard, t in table.items() if shard.startswith("tp"))
            sharing = "".join(f"; sharing at {p} processes ×{f:.3f}" for p, f in table.get("sharing", {}).items())
            lines.append(f"  {key}, {threads} thread(s): {shards}; AdamW "
                         f"{table['adamw']['s_per_param'] * 1e9:.2f} ns/param{sharing}")
    return lines
