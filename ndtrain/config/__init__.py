"""Typed run configuration: dataclasses, loaded from TOML and overridden from the command line.

Resolution order: defaults → model preset → TOML file → command-line flags and `--set key=value`.
Unknown keys, wrong types and impossible values raise `UserError` naming the key and the fix;
no float key takes nan or inf, no integer key more than 64 bits, and a config file is opened only
when it is a regular file (a FIFO would block) and read only as UTF-8 TOML.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from ndtrain.errors import UserError
from ndtrain.config.options import (
    ZERO_STAGES, Backend, CommDtype, DataFormat, Device, DpMode, PipelineBalance, PipelineSchedule, Precision,
    ProgressMode, PsMode, RecomputeMode, ZeroStage, literal_in, values,
)

BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (data/tokenizer.py), the least a model can have
INT64_MAX = 2**63 - 1
MAX_THREADS = 2**31 - 1  # torch.set_num_threads takes a C int
MAX_TIMEOUT_S = 1e9  # timedelta stops near 8.6e13 s

# Named model sizes. `tiny` keeps tests fast, `small` is the default run (≈3 M parameters),
# `bench` (≈13 M parameters) is what `ndtrain bench` measures.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=32),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, seq_len=128),
    "bench": dict(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024, seq_len=256),
    # `ndtrain bench` at larger sizes (Ψ with the byte vocabulary of 256): 25.4 M and 101.1 M parameters
    "bench-25m": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, seq_len=256),
    "bench-100m": dict(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, ffn_dim=2048, seq_len=256),
}

# Presets of the tasks other than the language model (run/tasks.py), with the defaults they bring to any
# section (below the TOML file and flags). `digits`: the CNN of models/digits.py (model.dim is its
# embedding size; the other model keys are unused); its run reaches CMC rank-1 >= 0.95 on CPU in seconds.
TASK_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "digits": {
        "model": dict(dim=64),
        "schedule": dict(steps=150, global_batch=64, micro_batch=32, warmup_steps=10),
        "optim": dict(lr=3e-3, weight_decay=0.01),
        "data": dict(eval_samples=0),
        "log": dict(eval_every=50),
        "parallel": dict(fsdp_wrap="features,project"),  # ZeRO-3 units: the conv stack, the projection; root: classifier
    },
}
PRESET_NAMES = (*MODEL_PRESETS, *TASK_PRESETS)


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    preset: str = "small"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 688
    vocab_size: int = 256
    seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    init_from: str | None = None  # weights to start from: an HF save_pretrained folder or a .safetensors file

    def validate(self) -> None:
        _positive(self, "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")
        _positive(self, "norm_eps", "rope_theta", "init_std")
        if self.init_from is not None and not _exists(self.init_from):
            raise UserError(f"model.init_from {self.init_from!r} does not exist: give an HF model folder or a .safetensors file")
        if self.dim % self.n_heads:
            raise UserError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.preset.startswith("hf:"):  # the HF config decides the rest (models/hf.py)
            return
        if (self.dim // self.n_heads) % 2:
            raise UserError(f"model head size dim/n_heads={self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}"
            )

    def parameter_count(self) -> int:
        """Ψ of the built-in Llama with these sizes (the formula in models/llama.py), by arithmetic;
        of an `hf:PATH` model, counted on a meta-device construction."""
        if self.preset.startswith("hf:"):
            from ndtrain.models import hf

            return hf.parameter_count(hf.hf_path(self.preset))
        d, head = self.dim, self.dim // self.n_heads
        layer = 2 * d * d + 2 * d * self.n_kv_heads * head + 3 * d * self.ffn_dim + 2 * d
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + self.n_layers * layer + d


@dataclass
class DataConfig:
    """Where the text comes from (`path=None` is the Python standard library's own source), how it
    is read and tokenized, and where its token file is cached (None: RUN_DIR/data). See ndtrain/data."""

    path: str | None = None
    val_fraction: float = 0.02
    eval_samples: int = 256
    tokenizer: str = "bytes"          # bytes | hf:PATH (a tokenizer.json or a tokenizer directory)
    format: DataFormat = "auto"
    text_field: str = "text"          # the text field/column of JSONL, Parquet and datasets records
    cache: str | None = None          # token-file folder (default RUN_DIR/data)

    def validate(self) -> None:
        _check_choices(self)
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.eval_samples < 0:
            raise UserError(f"data.eval_samples must be >= 0 (0 = whole validation set), got {self.eval_samples}")
        if self.path is not None and not self.path.strip():
            raise UserError("data.path is empty: leave it out for the standard library's source, or give a file or folder")
        if self.path is not None and not _exists(self.path):
            raise UserError(f"data.path {self.path!r} does not exist: give a text file, a folder or a .jsonl file")
        if not self.text_field:
            raise UserError('data.text_field is empty: name the field that holds the text (default "text")')
        if self.cache is not None and not self.cache.strip():
            raise UserError("data.cache is empty: leave it out for RUN_DIR/data, or give a folder")


@dataclass
class ParallelConfig:
    """The layout: world = dp × cp × pp × tp (tp fastest). `dp=0` means "whatever the world leaves"."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: ZeroStage = 0
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

    def validate(self) -> None:
        if self.dp < 0:
            raise UserError(f"parallel.dp must be >= 1 (or 0 to fill the world), got {self.dp}")
        _positive(self, "tp", "pp", "cp", "bucket_mb", "first_bucket_mb", "timeout_s", "pp_virtual", "replicas")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise UserError(f"parallel.timeout_s={self.timeout_s:g} exceeds {MAX_TIMEOUT_S:g} s (≈ 30 years): give fewer seconds")
        if not 0 < self.watchdog_s <= 120:
            raise UserError(
                f"parallel.watchdog_s must be in (0, 120] seconds, got {self.watchdog_s}: "
                "use a value above the longest wait on one collective (default 60)"
            )
        if self.zero not in ZERO_STAGES:
            raise UserError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        _check_choices(self)
        if self.dp_mode == "single-process" and self.zero > 1:
            raise UserError(
                f"parallel.dp_mode=single-process does not combine with parallel.zero={self.zero}: use zero 0 or 1"
            )
        if self.precision == "fp16" and not self.loss_scaling:
            raise UserError(
                "parallel.precision=fp16 needs loss scaling (fp16 gradients underflow without it): "
                "set parallel.loss_scaling=true or use precision=bf16"
            )
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
class OptimConfig:
    """AdamW with global-norm gradient clipping (`grad_clip=0` disables clipping).

    A NaN/inf loss or gradient norm (fp32/bf16) stops the run naming the step; `skip_nonfinite`
    skips such steps instead (fp16 always skips them through its loss scaler)."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    skip_nonfinite: bool = False

    def validate(self) -> None:
        _positive(self, "lr", "eps")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("optim.weight_decay and optim.grad_clip must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")


@dataclass
class ScheduleConfig:
    """Steps, batch and learning-rate schedule (linear warmup, cosine decay to min_lr_ratio·lr).

    `global_batch` sequences per optimizer step are split over the dp ranks and then into
    micro-batches of `micro_batch` sequences; gradient accumulation covers the rest.
    """

    steps: int = 200
    global_batch: int = 32
    micro_batch: int = 16
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        _positive(self, "steps", "global_batch", "micro_batch")
        if self.warmup_steps < 0:
            raise UserError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def accumulation_steps(self, dp: int) -> int:
        """Micro-steps per optimizer step on each rank; the batch must split evenly."""
        per_rank, rest = divmod(self.global_batch, dp)
        if rest or per_rank % self.micro_batch:
            raise UserError(
                f"schedule.global_batch={self.global_batch} is not divisible by dp={dp} × "
                f"schedule.micro_batch={self.micro_batch}: change one of them"
            )
        return per_rank // self.micro_batch


@dataclass
class CheckpointConfig:
    """DCP checkpoints in RUN_DIR/checkpoints every `save_every` steps (0 = only at the end).

    `exit_after` > 0 stops this invocation after that many steps with a checkpoint, for jobs
    with a time limit; running the same command again continues the run. `overwrite` deletes the
    run directory's checkpoints and metrics and starts over (the only way to start over in a
    directory that holds checkpoints).
    """

    save_every: int = 0
    keep: int = 2
    resume: bool = False
    exit_after: int = 0
    overwrite: bool = False

    def validate(self) -> None:
        if self.save_every < 0 or self.exit_after < 0:
            raise UserError("checkpoint.save_every and checkpoint.exit_after must be >= 0")
        _positive(self, "keep")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite exclude each other: continue the run or start it over, not both")


@dataclass
class LogConfig:
    """Run directory, evaluation cadence and progress display.

    `every`: a metrics record and a progress line every N steps (`log_every` is its old name, still
    read). `progress`: auto (a bar on a terminal, lines otherwise), bar, lines or off; true/false
    mean auto/off. `report_to`: experiment trackers (run/trackers.py).
    """

    out: str = "runs/default"
    eval_every: int = 50
    every: int = 10
    progress: bool | ProgressMode = "auto"
    report_to: list[str] = field(default_factory=list)  # any of "tensorboard", "wandb", "mlflow"
    timeline: bool | int = False  # pp > 1: record one step's pipeline timeline (true: step 2; N: step N)

    def __post_init__(self) -> None:
        if isinstance(self.progress, bool):
            self.progress = "auto" if self.progress else "off"

    def validate(self) -> None:
        if not isinstance(self.timeline, bool) and self.timeline < 1:
            raise UserError(f"log.timeline must be true, false or a step number >= 1, got {self.timeline}")
        if not self.out.strip():
            raise UserError("log.out (--out) is empty: give the run directory, e.g. --out runs/my-run")
        if self.eval_every < 0:
            raise UserError(f"log.eval_every must be >= 0 (0 = only at the end), got {self.eval_every}")
        _positive(self, "every")
        _check_choices(self)
        from ndtrain.run.trackers import check_trackers

        check_trackers(self.report_to)


@dataclass
class LaunchConfig:
    """Local processes started by `ndtrain train` (ignored when an external torchrun started us).

    `max_restarts`: how many times a dead worker group is restarted (resuming from the newest
    checkpoint) before the run fails.
    """

    nproc: int = 2
    threads: int = 0
    max_restarts: int = 3

    def validate(self) -> None:
        _positive(self, "nproc")
        if self.max_restarts < 0:
            raise UserError(f"launch.max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise UserError(f"launch.threads must be in [0, {MAX_THREADS}] (0 = cores / nproc), got {self.threads}")


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
        _check_choices(self)
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


@dataclass
class TrainConfig:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    ps: PSConfig = field(default_factory=PSConfig)

    def validate(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be in [0, 2**63), got {self.seed}")
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.validate()
        p = self.parallel
        if self.model.preset in TASK_PRESETS and (p.tp * p.pp * p.cp > 1 or self.ps.servers or self.data.path is not None):
            raise UserError(
                f"--model {self.model.preset} trains on its own data with data parallelism only (dp, zero, dp_mode): "
                "leave data.path unset and tp, pp, cp at 1, ps.servers at 0"
            )
        if p.overlap_optimizer and (self.optim.grad_clip > 0 or self.optim.skip_nonfinite or p.precision == "fp16"):
            raise UserError(
                "parallel.overlap_optimizer=true updates parameters during backward, before the global gradient norm "
                "exists: set optim.grad_clip=0 and optim.skip_nonfinite=false (and no fp16), or overlap_optimizer=false"
            )
        from ndtrain.data.tokenizer import tokenizer_vocab_size

        tokens = tokenizer_vocab_size(self.data.tokenizer)  # BYTE_VOCAB for bytes; a model alone may have any vocabulary
        if self.model.vocab_size < tokens:
            whose = (f"the byte tokenizer's {tokens} tokens" if self.data.tokenizer == "bytes"
                     else f"the {tokens} tokens of data.tokenizer={self.data.tokenizer!r}")
            raise UserError(
                f"model.vocab_size={self.model.vocab_size} is smaller than {whose}: "
                f"use model.vocab_size >= {tokens}, or leave it out to take the tokenizer's"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Build a validated `TrainConfig` from an optional TOML file and dotted-key overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(path)
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    cfg = config_from_dict(raw)
    cfg.validate()
    return cfg


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path` as a dict; anything but a readable UTF-8 TOML file is a UserError.
    The file type is checked before opening (a FIFO would block)."""
    name = str(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UserError(f"config file {name!r} is not a regular file: give a TOML file")
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"config file {name!r} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read config file {name!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {name!r} is not UTF-8 text: give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {name!r} is not valid TOML: {e}") from None
    except ValueError as e:  # a path the OS cannot take (NUL byte)
        raise UserError(f"config file {name!r} cannot be opened: {e}") from None


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Typed config from a nested dict; a model preset is applied before explicit model keys."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    model_raw = raw.get("model", {})
    if not isinstance(model_raw, dict):
        raise UserError("config key 'model' must be a table")
    preset = model_raw.get("preset", ModelConfig.preset)
    hf_path = None
    if isinstance(preset, str) and preset.startswith("hf:"):
        raw["model"], hf_path = _hf_model_raw(preset, model_raw)
    elif not isinstance(preset, str) or preset not in PRESET_NAMES:
        raise UserError(f"model.preset={preset!r} is unknown: choose one of {', '.join(PRESET_NAMES)} or hf:PATH")
    else:
        raw["model"] = {**MODEL_PRESETS.get(preset, {}), **model_raw, "preset": preset}
        for section, defaults in TASK_PRESETS.get(preset, {}).items():
            given = raw.get(section, {})
            raw[section] = {**defaults, **given} if isinstance(given, dict) else given
        data_raw = raw.get("data")
        tokenizer = data_raw.get("tokenizer") if isinstance(data_raw, dict) else None
        if "vocab_size" not in model_raw and isinstance(tokenizer, str) and tokenizer != "bytes":
            from ndtrain.data.tokenizer import tokenizer_vocab_size

            raw["model"]["vocab_size"] = tokenizer_vocab_size(tokenizer)  # not given: the tokenizer's
    log_raw = raw.get("log")
    if isinstance(log_raw, dict) and "log_every" in log_raw:  # the old name of log.every
        if "every" in log_raw:
            raise UserError("log.log_every is the old name of log.every: give only log.every")
        log_raw["every"] = log_raw.pop("log_every")
    cfg = _build(TrainConfig, raw, prefix="")
    if hf_path is not None:
        from ndtrain.models.hf import check_seq_len

        check_seq_len(hf_path, cfg.model.seq_len)
    return cfg


def _hf_model_raw(preset: str, model_raw: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """The model table of an `hf:PATH` preset: sizes from PATH/config.json (the path made absolute,
    so the run directory's config.toml stays valid from anywhere); explicit keys may only repeat them."""
    from ndtrain.models.hf import config_sizes, hf_path

    path = hf_path(preset).expanduser().resolve()
    sizes = config_sizes(path)
    for key, value in model_raw.items():
        if key in sizes and key != "seq_len" and value != sizes[key]:
            raise UserError(
                f"model.{key}={value!r} differs from {sizes[key]!r} in {str(path / 'config.json')!r}: "
                f"the HF config decides the model's sizes; drop model.{key}"
            )
    return {**model_raw, **{k: v for k, v in sizes.items() if k not in model_raw or k != "seq_len"},
            "preset": f"hf:{path}"}, path


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` from `--set`; the value is read as TOML (numbers, booleans, quoted strings) or a bare string."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise UserError(f"--set expects key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"config key {key!r}: {part!r} is not a section")
    node[leaf] = value


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            where = f"in section [{prefix[:-1]}]" if prefix else "at top level"
            raise UserError(f"unknown config key {prefix + key!r} {where}: valid keys are {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in raw.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise UserError(f"config key {prefix + key!r} must be a table")
            kwargs[key] = _build(hint, value, prefix + key + ".")
        else:
            kwargs[key] = _check_type(prefix + key, value, hint)
    return cls(**kwargs)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    # an options Literal is checked here for its values' type; `_check_choices` (validate) checks the value
    options = tuple(type(values(o)[0]) if typing.get_origin(o) is typing.Literal else o for o in options)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT64_MAX:
                raise UserError(f"config key {key!r} = {value} does not fit in 64 bits: give a smaller number")
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise UserError(f"config key {key!r} must be a finite number, got {value}")
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    names = " or ".join("none" if o is type(None) else str(o) if typing.get_origin(o) else o.__name__ for o in options)
    raise UserError(f"config key {key!r} must be {names}, got {value!r} ({type(value).__name__})")


def _positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise UserError(f"{_section_name(section)}.{name} must be > 0, got {value}")


def _exists(path: str) -> bool:
    """Whether `path` names something; a name the OS cannot take (NUL byte, too long) does not."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def _check_choices(section: Any) -> None:
    """Every field of `section` annotated with an options Literal holds one of its values."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        option = literal_in(hints[f.name])
        value = getattr(section, f.name)
        if option is not None and value not in values(option):
            allowed = ", ".join(str(v) for v in values(option))
            raise UserError(f"{_section_name(section)}.{f.name}={value!r} is not one of {allowed}")


def allowed_values(key: str) -> tuple[Any, ...] | None:
    """The values a dotted config key (`parallel.precision`) is limited to, from its annotation; None for an open key."""
    section: Any = TrainConfig
    *parents, name = key.split(".")
    for part in parents:
        section = typing.get_type_hints(section)[part]
    option = literal_in(typing.get_type_hints(section)[name])
    return None if option is None else values(option)


def _section_name(section: Any) -> str:
    return type(section).__name__.removesuffix("Config").lower()


def dump_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config (None keys omitted)."""
    lines: list[str] = []
    sections = []
    for key, value in cfg.to_dict().items():
        if isinstance(value, dict):
            sections.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in sections:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None)
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
