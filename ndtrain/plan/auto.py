"""`ndtrain train --layout auto`: the planner's fastest layout that fits this machine, for a run's config.

Inputs: the run's built-in model (the sizes its config resolved, so `--seq-len` and `--set model.dim=...`
count), `nproc` processes on this one machine, the run's global batch, and the layout keys the user set
(`fixed_axes`: each one fixed, the rest searched, as `ndtrain plan`'s flags). The machine is a calibrated
CPU profile (`cpu_profile.load_profile` for nproc processes) or, on CUDA, the datasheet of the GPU the
device name names (`hardware.gpu_for_device`): one node of nproc GPUs. `layout_overrides` is the choice
as dotted config keys, which `apply` writes into the config (and the launcher hands its workers).

An Adafactor run keeps zero 0 and tp 1 (`optimizer_limits`). Refused in one line: an `hf:` model or a
task preset (the planner knows ndtrain's Llama only), a parameter server or single-process DataParallel
(not layouts the planner enumerates), a CPU run without a profile, a GPU the planner has no datasheet
for, and a run where nothing fits.

Cost: one `search`, pure arithmetic (milliseconds for a few processes; the layouts grow with the
divisors of nproc), plus reading the profile.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ndtrain.config import MODEL_PRESETS, TrainConfig, is_hf_preset
from ndtrain.errors import UserError
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.cpu_profile import load_profile
from ndtrain.plan.hardware import Cluster, Hardware, gpu, gpu_for_device
from ndtrain.plan.layout import Layout
from ndtrain.plan.search import Candidate, Fixed, search

MIB = 1024**2
# config key → the `Fixed` axis it sets when the user gives it
LAYOUT_KEYS: dict[str, str] = {
    "parallel.tp": "tp", "parallel.pp": "pp", "parallel.dp": "dp", "parallel.cp": "cp", "parallel.zero": "zero",
    "schedule.micro_batch": "mbs", "parallel.pp_virtual": "vpp", "parallel.recompute": "recompute",
    "parallel.sequence_parallel": "sp", "parallel.pp_schedule": "schedule",
}
LAYOUT_FLAGS = "--tp/--pp/--dp/--cp/--zero"


@dataclass(frozen=True)
class Choice:
    """The layout chosen, its predictions, how many layouts were weighed, and what machine they were for."""

    candidate: Candidate
    considered: int
    feasible: int
    machine: str  # "CPU profile PATH" or a GPUS key
    profile: Path | None

    @property
    def layout(self) -> Layout:
        return self.candidate.layout

    @property
    def step_s(self) -> float:
        return self.candidate.timing.step

    @property
    def memory_bytes(self) -> float:
        return self.candidate.memory.total

    def line(self) -> str:
        """The one line printed before training."""
        return (f"ndtrain: layout auto: {self.layout.label()}: predicted step {self.step_s * 1e3:.1f} ms, peak memory "
                f"{self.memory_bytes / MIB:,.0f} MiB per rank ({self.machine}; {self.considered} layouts considered, "
                f"{self.feasible} fit)")

    def record(self) -> dict[str, Any]:
        """What RUN_DIR/layout-auto.json holds before the run (the launcher adds the measured step after it)."""
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "predicted_step_s": self.step_s,
                "predicted_memory_bytes": self.memory_bytes, "machine": self.machine,
                "profile": None if self.profile is None else str(self.profile.resolve()),
                "considered": self.considered, "feasible": self.feasible}


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The planner's spec of the run's built-in Llama, at the sizes the config resolved."""
    preset = cfg.model.preset
    if is_hf_preset(preset):
        raise UserError(f"--layout auto reads built-in presets only; pass the layout flags ({LAYOUT_FLAGS})")
    if preset not in MODEL_PRESETS:
        raise UserError(f"--layout auto plans the built-in language models ({', '.join(MODEL_PRESETS)}); --model "
                        f"{preset} is a task with data parallelism only: use --layout manual")
    m = cfg.model
    return ModelSpec(f"ndtrain-{preset}", "llama", m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size,
                     m.seq_len)


def machine(device_type: str, device_name: str, profile: Path, nproc: int, preset: str) -> tuple[Hardware, str]:
    """This machine as the planner sees it for `nproc` processes, and how to name it: the CPU profile at
    `profile`, or on CUDA the datasheet of the GPU named `device_name`."""
    if device_type == "cuda":
        key = gpu_for_device(device_name)
        if key is None:
            raise UserError(f"--layout auto has no datasheet for the GPU {device_name!r}: pass the layout flags "
                            f"({LAYOUT_FLAGS}), e.g. what `ndtrain plan --gpu NAME --gpus N ...` recommends")
        return gpu(key), key
    if not profile.is_file():
        raise UserError(f"--layout auto on CPU plans with a calibrated profile and {str(profile)!r} is not a file: "
                        f"write it with `ndtrain plan --calibrate --model {preset} --out {profile}` (≈5 min), or give "
                        "--profile PATH")
    return load_profile(profile, nproc), f"CPU profile {profile}"


def fixed_axes(given: dict[str, Any]) -> Fixed:
    """The `Fixed` of the layout keys the user set (`given`: dotted key → value); dp 0 ("fill") is not fixed."""
    axes = {LAYOUT_KEYS[key]: value for key, value in given.items() if key in LAYOUT_KEYS}
    if axes.get("dp") == 0:
        del axes["dp"]
    return Fixed(**axes)


def choose(cfg: TrainConfig, nproc: int, fixed: Fixed, hardware: Hardware, machine_name: str,
           profile: Path | None) -> Choice:
    """The layout `search` ranks first for this run on `nproc` processes of `hardware`."""
    if cfg.ps.servers or cfg.parallel.dp_mode != "ddp":
        raise UserError("--layout auto plans dp × cp × pp × tp layouts with ZeRO: set ps.servers=0 and "
                        "parallel.dp_mode=ddp, or use --layout manual")
    spec = model_spec(cfg)
    result = search(spec, Cluster(hardware, nproc, nproc), cfg.schedule.global_batch, optimizer_limits(cfg, fixed))
    fitting = [c for c in result.candidates if c.fits]
    if not fitting:
        smallest = result.candidates[0]
        raise UserError(f"--layout auto: no layout fits in memory (the smallest, {smallest.layout.label()}, needs "
                        f"{smallest.memory.total / MIB:,.0f} MiB per rank of {hardware.memory_bytes / MIB:,.0f}): add "
                        "processes, recompute or ZeRO, or use a smaller model or batch")
    return Choice(fitting[0], result.considered, len(fitting), machine_name, profile)


def optimizer_limits(cfg: TrainConfig, fixed: Fixed) -> Fixed:
    """`fixed` with the axes the run's optimizer rules out: Adafactor's factored moments need whole matrices,
    so ZeRO and tp are refused for it (config/train.py) and not searched (zero 0, tp 1 unless given)."""
    if cfg.optim.name != "adafactor":
        return fixed
    return dataclasses.replace(fixed, zero=0 if fixed.zero is None else fixed.zero, tp=fixed.tp or 1)


def layout_overrides(layout: Layout) -> dict[str, Any]:
    """The chosen layout as dotted config keys, `parallel.layout = "manual"` among them: a run given these
    keys trains the same layout without planning."""
    keys: dict[str, Any] = {
        "parallel.layout": "manual", "parallel.tp": layout.tp, "parallel.pp": layout.pp,
        "parallel.dp": layout.dp, "parallel.cp": layout.cp, "parallel.zero": layout.zero,
        "parallel.recompute": layout.recompute, "parallel.sequence_parallel": layout.sp,
        "parallel.pp_virtual": layout.vpp, "schedule.micro_batch": layout.mbs,
    }
    if layout.pp > 1:
        keys["parallel.pp_schedule"] = layout.schedule
    return keys


def apply(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """A copy of `cfg` with the dotted keys set, validated."""
    cfg = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.validate()
    return cfg

