"""The layout of the processes: how the world is split (`ParallelConfig`: world = dp × cp × pp × tp,
tp fastest, with each strategy's options) or given to a parameter server (`PSConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ndtrain.config.checks import check_choices, positive
from ndtrain.config.options import (
    ZERO_STAGES, Backend, CommDtype, Device, DpMode, LayoutMode, PipelineBalance, PipelineSchedule, Precision,
    PsMode, RecomputeMode, ZeroStage,
)
from ndtrain.errors import UserError

MAX_TIMEOUT_S = 1e9  # timedelta stops near 8.6e13 s
PHASE_DEADLINES = ("startup_s", "eval_s", "save_s", "save_mb_s")
DEFAULT_LAYOUT_PROFILE = "plan-profile.json"  # what `ndtrain plan --calibrate` writes and --layout auto reads


@dataclass
class ParallelConfig:
    """The layout: world = dp × cp × pp × tp (tp fastest). `dp=0` means "whatever the world leaves"."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: ZeroStage = 0
    # manual: the axes above as given; auto: the launcher asks the planner for the fastest layout that fits
    # (explicitly given axes stay fixed) and writes it into them (cli/layout_auto.py)
    layout: LayoutMode = "manual"
    layout_profile: str = DEFAULT_LAYOUT_PROFILE  # the calibrated CPU profile --layout auto plans with on CPU
    backend: Backend = "auto"
    device: Device = "auto"
    bucket_mb: float = 25.0
    # DDP levers (zero 0, fp32; README "DDP"): first bucket cap, buckets in the order step 1 produced
    # gradients, flat AdamW over the buckets (any zero stage and precision: AdamW on torch's fused
    # kernel over the optimizer's flat segments), its update overlapped with the all-reduces (grad_clip=0)
    first_bucket_mb: float = 1.0
    reorder_buckets: bool = False
    flat_adamw: bool = False
    overlap_optimizer: bool = False
    # DDP / ZeRO-1 / ZeRO-2 buckets and ZeRO-3 units on CPU: ranks of one host communicate through shared memory (dist/host_slots.py)
    host_shared_memory: bool = True
    comm_dtype: CommDtype = "fp32"    # dtype of gradient reductions (the "reduce dtype")
    allow_unused_params: bool = False
    timeout_s: float = 600.0          # init/rendezvous timeout (and the communication library's own)
    watchdog_s: float = 60.0          # a wait on one collective longer than this ends the run, naming who is missing
    # phase deadlines (dist/phases.py): past one, the run ends (or restarts) naming the phase and who is missing
    startup_s: float = 600.0          # each start-up step: joining the group (from the process start), data, model
    eval_s: float = 300.0             # one evaluation: this + 4 × its windows × the last step's seconds per window
    save_s: float = 120.0             # one checkpoint save or load: this + its size at save_mb_s
    save_mb_s: float = 10.0           # the disk speed a save or load assumes (MB/s), lower if one was measured slower
    # mixed precision: compute dtype; fp32 master weights and optimizer state in every mode
    precision: Precision = "fp32"
    loss_scaling: bool = True         # dynamic loss scaling (required for fp16)
    # activation recomputation per transformer block
    recompute: RecomputeMode = "none"
    # ZeRO-3 / FSDP
    fsdp_wrap: str = "auto"           # auto (one unit per decoder layer) | comma-separated fnmatch patterns
    reshard_after_forward: bool = True
    # tensor parallel
    sequence_parallel: bool = False
    # pipeline parallel: the micro-batches are the step's gradient-accumulation micro-batches
    pp_schedule: PipelineSchedule = "1f1b"
    pp_virtual: int = 1               # virtual stages per rank (interleaved)
    pp_balance: PipelineBalance = "params"
    # data-parallel flavour: our DDP over processes, or single-process DataParallel over replicas
    dp_mode: DpMode = "ddp"
    replicas: int = 2                 # devices (CPU replicas when no GPU) for dp_mode=single-process
    # BatchNorm and buffers over dp×cp (parallel/data/sync_batchnorm.py, parallel/data/buffers.py)
    sync_batchnorm: bool = False      # every BatchNorm normalises over the global batch (statistics all-gathered)
    broadcast_buffers: bool = False   # group rank 0's buffers broadcast before each step and evaluation

    def validate(self) -> None:
        if self.dp < 0:
            raise UserError(f"parallel.dp must be >= 1 (or 0 to fill the world), got {self.dp}")
        positive(self, "tp", "pp", "cp", "bucket_mb", "first_bucket_mb", "timeout_s", "pp_virtual", "replicas")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise UserError(f"parallel.timeout_s={self.timeout_s:g} exceeds {MAX_TIMEOUT_S:g} s (≈ 30 years): give fewer seconds")
        for name in PHASE_DEADLINES:
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise UserError(f"parallel.{name} must be in (0, {MAX_TIMEOUT_S:g}], got {getattr(self, name)}: "
                                f"give a positive number of {'MB/s' if name == 'save_mb_s' else 'seconds'}")
        if not 0 < self.watchdog_s <= 120:
            raise UserError(
                f"parallel.watchdog_s must be in (0, 120] seconds, got {self.watchdog_s}: "
                "use a value above the longest wait on one collective (default 60)"
            )
        if self.zero not in ZERO_STAGES:
            raise UserError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        check_choices(self)
        if self.dp_mode == "single-process" and self.zero > 1:
            raise UserError(
                f"parallel.dp_mode=single-process does not combine with parallel.zero={self.zero}: use zero 0 or 1"
            )
        if self.precision == "fp16" and not self.loss_scaling:
            raise UserError(
                "parallel.precision=fp16 needs loss scaling (fp16 gradients underflow without it): "
                "set parallel.loss_scaling=true or use precision=bf16"
            )
        if not self.layout_profile.strip():
            raise UserError("parallel.layout_profile (--profile) is empty: give the CPU profile `ndtrain plan "
                            f"--calibrate` wrote (default {DEFAULT_LAYOUT_PROFILE})")
        if not [p for p in self.fsdp_wrap.split(",") if p.strip()]:
            raise UserError("parallel.fsdp_wrap is empty: give module-name patterns such as 'layers.*'")
        self._check_combination()
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            raise UserError(
                f"parallel.pp_virtual={self.pp_virtual} needs parallel.pp_schedule=interleaved "
                f"(got {self.pp_schedule!r})"
            )

    def _check_combination(self) -> None:
        """Refuse the combinations the engine does not support, each in one line."""
        refused = {
            "parallel.sequence_parallel=true needs tp > 1": self.sequence_parallel and self.tp == 1,
            "dp_mode=single-process with tp/pp/cp > 1 is not supported": self.dp_mode != "ddp" and self.tp * self.pp * self.cp > 1,
        }
        refused["parallel.overlap_optimizer=true needs parallel.flat_adamw=true (it overlaps the flat AdamW's "
                "bucket updates)"] = self.overlap_optimizer and not self.flat_adamw
        levers = [f"parallel.{name}=true" for name in ("reorder_buckets", "overlap_optimizer") if getattr(self, name)]
        refused[f"{levers[0] if levers else ''} is a DDP lever for zero=0 in fp32 (ZeRO and mixed precision lay their "
                "buffers out over the buckets as built): set it false, or zero=0 and precision=fp32"] = \
            bool(levers) and (self.zero > 0 or self.precision != "fp32" or self.dp_mode != "ddp")
        refused["parallel.flat_adamw=true needs dp_mode=ddp (single-process replicas step one optimizer "
                "per replica as built)"] = self.flat_adamw and self.dp_mode != "ddp"
        refused["parallel.sync_batchnorm=true needs dp_mode=ddp (single-process replicas are threads of one process, "
                "each normalising its own slice)"] = self.sync_batchnorm and self.dp_mode != "ddp"
        refused["parallel.sync_batchnorm=true reduces BatchNorm statistics over dp only: tp, pp and cp split "
                "transformer models, which have no BatchNorm, and a BatchNorm under tp would see channel or token "
                "shards; set tp, pp and cp to 1"] = self.sync_batchnorm and self.tp * self.pp * self.cp > 1
        refused["parallel.sync_batchnorm=true with recompute: a recomputed forward would reduce the statistics and "
                "update the running ones twice; set parallel.recompute=none"] = \
            self.sync_batchnorm and self.recompute != "none"
        for message, bad in refused.items():
            if bad:
                raise UserError(message)

    def resolve_dp(self, world_size: int) -> int:
        """The dp degree for this world, checking that the axes multiply to it exactly."""
        model_parallel = self.tp * self.pp * self.cp
        dp = self.dp or world_size // model_parallel
        if dp < 1 or dp * model_parallel != world_size:
            raise UserError(
                f"layout dp={self.dp or '?'} × cp={self.cp} × pp={self.pp} × tp={self.tp} does not equal "
                f"the world size {world_size}: change the axes or the number of processes"
            )
        return dp



@dataclass
class PSConfig:
    """Parameter-server training: `servers` ranks hold the parameters, the other ranks are workers.

    `servers=0` turns the mode off. `mode`: sync (same math as DDP), async (every push applied on
    arrival), ssp (a worker may run at most `staleness` steps ahead of the slowest). `slow_worker`
    ("RANK:FACTOR") makes one worker FACTOR× slower, for experiments."""

    servers: int = 0
    mode: PsMode = "sync"
    staleness: int = 2
    slow_worker: str = ""

    def validate(self) -> None:
        if self.servers < 0:
            raise UserError(f"ps.servers must be >= 0 (0 = off), got {self.servers}")
        if self.staleness < 0:
            raise UserError(f"ps.staleness must be >= 0, got {self.staleness}")
        check_choices(self)
        self.straggler()

    def straggler(self) -> tuple[int, float] | None:
        """`slow_worker` parsed as (rank, factor >= 1), or None when empty."""
        if not self.slow_worker:
            return None
        rank, sep, factor = self.slow_worker.partition(":")
        try:
            parsed = (int(rank), float(factor))
        except ValueError:
            parsed = None
        if not sep or parsed is None or parsed[0] < 0 or not 1.0 <= parsed[1] < math.inf:
            raise UserError(f"ps.slow_worker={self.slow_worker!r} must be RANK:FACTOR with finite FACTOR >= 1, e.g. '1:2'")
        return parsed

    def check_world(self, world_size: int) -> None:
        """Servers and the straggler must fit a world of `world_size` ranks (workers first)."""
        if self.servers >= world_size:
            raise UserError(
                f"ps.servers={self.servers} leaves no worker among {world_size} processes: "
                f"use ps.servers < {world_size} or more processes (--nproc)"
            )
        slow = self.straggler()
        if slow is not None and slow[0] >= world_size - self.servers:
            raise UserError(
                f"ps.slow_worker rank {slow[0]} is not a worker: workers are ranks 0..{world_size - self.servers - 1}"
            )
