"""The sections of the run configuration other than the layout (parallel.py): one dataclass per TOML
table, each with the defaults of a run and a `validate` that checks its own values (checks.py).

model (sizes of the built-in Llama, or an `hf:PATH` model), data (corpus, tokenizer, token cache),
optim (AdamW, SGD or Adafactor, clipping), schedule (steps, batch, learning-rate schedule), checkpoint (cadence, resume),
log (run directory, evaluation, progress, trackers), launch (local processes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ndtrain.config.checks import check_choices, exists, positive
from ndtrain.config.options import (Attention, DataFormat, DataKind, DigitsNet, LossOn, LrScaling, LrScheduler,
                                     OptimName, Overlong, ProgressMode)
from ndtrain.config.presets import DEFAULT_PRESET, is_hf_preset
from ndtrain.errors import UserError

MAX_THREADS = 2**31 - 1  # torch.set_num_threads takes a C int


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    preset: str = DEFAULT_PRESET
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
    digits_net: DigitsNet = "cnn"  # --model digits: the plain CNN, or bn_cnn (BatchNorm after every layer)
    attention: Attention = "auto"  # an hf: model's: auto = sdpa where its class supports it, else eager (models/hf.py)

    def validate(self) -> None:
        positive(self, "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")
        check_choices(self)
        if self.digits_net != "cnn" and self.preset != "digits":
            raise UserError(f"model.digits_net={self.digits_net!r} chooses the digits task's model: use it with --model digits")
        if self.attention != "auto" and not is_hf_preset(self.preset):
            raise UserError(f"model.attention={self.attention!r} chooses a Hugging Face model's attention implementation: "
                            "use it with --model hf:PATH")
        positive(self, "norm_eps", "rope_theta", "init_std")
        if self.init_from is not None and not exists(self.init_from):
            raise UserError(f"model.init_from {self.init_from!r} does not exist: give an HF model folder or a .safetensors file")
        if self.dim % self.n_heads:
            raise UserError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if is_hf_preset(self.preset):  # the HF config decides the rest (models/hf.py)
            return
        if (self.dim // self.n_heads) % 2:
            raise UserError(f"model head size dim/n_heads={self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}"
            )

    def parameter_count(self) -> int:
        """Ψ of the built-in Llama with these sizes (the formula in models/llama.py), by arithmetic.
        An `hf:PATH` model is counted on its construction: `ndtrain.run.config_checks.parameter_count`."""
        if is_hf_preset(self.preset):
            raise ValueError(f"model.preset={self.preset!r}: count it with ndtrain.run.config_checks.parameter_count")
        d, head = self.dim, self.dim // self.n_heads
        layer = 2 * d * d + 2 * d * self.n_kv_heads * head + 3 * d * self.ffn_dim + 2 * d
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + self.n_layers * layer + d


@dataclass
class DataConfig:
    """Where the text comes from (`path=None` is the Python standard library's own source), how it
    is read and tokenized, and where its token file is cached (None: RUN_DIR/data). See ndtrain/data.

    Fine-tuning (data/sft.py): `kind` says what a record is (auto: detected from the first record),
    `loss_on` which tokens are targets, `max_length` (None: model.seq_len + 1) the longest example kept
    whole, `overlong` whether a longer one is truncated or dropped; `packing` packs documents into
    windows, else each sample is one document, padded (data/corpus.py).

    A checkpoint records which data it was trained on (data/identity.py); resuming it on other data is
    refused unless `allow_change`, which restarts the data order at the new data's first batch."""

    path: str | None = None
    val_fraction: float = 0.02
    eval_samples: int = 256
    tokenizer: str = "bytes"          # bytes | hf:PATH (a tokenizer.json or a tokenizer directory)
    format: DataFormat = "auto"       # the file format
    text_field: str = "text"          # the text field/column of JSONL, Parquet and datasets records
    cache: str | None = None          # token-file folder (default RUN_DIR/data)
    allow_change: bool = False        # resume a checkpoint on other data, restarting the data order
    kind: DataKind = "auto"           # text | chat | instruction | completion records
    loss_on: LossOn = "assistant"     # fine-tuning targets: assistant turns, the completion only, or all
    max_length: int | None = None     # tokens of the longest example, its EOS counted (None: seq_len + 1)
    overlong: Overlong = "truncate"   # an example above max_length: truncate or drop
    packing: bool = True              # pack documents into windows (false: one padded example a sample)

    def validate(self) -> None:
        check_choices(self)
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.eval_samples < 0:
            raise UserError(f"data.eval_samples must be >= 0 (0 = whole validation set), got {self.eval_samples}")
        if self.path is not None and not self.path.strip():
            raise UserError("data.path is empty: leave it out for the standard library's source, or give a file or folder")
        if self.path is not None and not exists(self.path):
            raise UserError(f"data.path {self.path!r} does not exist: give a text file, a folder or a .jsonl file")
        if not self.text_field:
            raise UserError('data.text_field is empty: name the field that holds the text (default "text")')
        if self.cache is not None and not self.cache.strip():
            raise UserError("data.cache is empty: leave it out for RUN_DIR/data, or give a folder")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"data.max_length must be >= 2 (a token and its target), got {self.max_length}")

    def length_limit(self, seq_len: int) -> int:
        """The longest fine-tuning example or unpacked document kept whole: data.max_length, by default
        seq_len + 1 tokens (one sample); never more."""
        if self.max_length is not None and self.max_length > seq_len + 1:
            raise UserError(f"data.max_length={self.max_length} is longer than a sample of model.seq_len={seq_len} + 1 "
                            f"tokens: give at most {seq_len + 1}, or raise model.seq_len")
        return self.max_length or seq_len + 1


@dataclass
class OptimConfig:
    """The optimizer (`name`: torch.optim's AdamW, SGD or Adafactor) with global-norm gradient clipping
    (`grad_clip=0` disables clipping). AdamW reads beta1, beta2 and eps; SGD `momentum` (its
    `weight_decay` is torch's L2 term); Adafactor keeps torch's own beta2_decay and eps. Every one decays
    matrices only (the engine's default parameter groups). Adafactor's second moments of a matrix are
    factored (a row and a column vector), so it needs whole parameters on each rank (`TrainConfig.validate`).

    A NaN/inf loss or gradient norm (fp32/bf16) stops the run naming the step; `skip_nonfinite`
    skips such steps instead (fp16 always skips them through its loss scaler).

    `lr_scaling`: `lr` was tuned for a global batch of `reference_batch` samples; the run's peak
    learning rate is `lr` × G/`reference_batch` (linear) or × √(G/`reference_batch`) (sqrt), G the
    run's `schedule.global_batch` (`scaled_lr`)."""

    name: OptimName = "adamw"
    lr: float = 3e-3
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    skip_nonfinite: bool = False
    lr_scaling: LrScaling = "none"
    reference_batch: int | None = None  # the global batch (samples) `lr` was tuned for

    def validate(self) -> None:
        positive(self, "lr", "eps")
        check_choices(self)
        if self.reference_batch is not None and self.reference_batch <= 0:
            raise UserError(f"optim.reference_batch must be > 0 (the global batch optim.lr was tuned for), got {self.reference_batch}")
        if self.lr_scaling != "none" and self.reference_batch is None:
            raise UserError(f"optim.lr_scaling={self.lr_scaling!r} needs optim.reference_batch: the global batch optim.lr was tuned for")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("optim.weight_decay and optim.grad_clip must be >= 0")
        for name in ("beta1", "beta2", "momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")

    def lr_factor(self, global_batch: int) -> float:
        """What `lr` is multiplied by for a run of `global_batch` samples per step (1 without scaling)."""
        if self.lr_scaling == "none" or self.reference_batch is None:
            return 1.0
        ratio = global_batch / self.reference_batch
        return ratio if self.lr_scaling == "linear" else math.sqrt(ratio)

    def scaled_lr(self, global_batch: int) -> float:
        """The peak learning rate of a run of `global_batch` samples per step: `lr` × `lr_factor`."""
        return self.lr * self.lr_factor(global_batch)

    def describe_lr(self, global_batch: int) -> str:
        """The run description's line: `lr 0.003 × 2 (linear, global batch 64 / reference 32) = 0.006`."""
        if self.lr_scaling == "none":
            return f"lr {self.lr:g} (optim.lr_scaling = none)"
        return (f"lr {self.lr:g} × {self.lr_factor(global_batch):.4g} ({self.lr_scaling}, global batch {global_batch} / "
                f"reference {self.reference_batch}) = {self.scaled_lr(global_batch):.4g}")


@dataclass
class ScheduleConfig:
    """Steps, batch and learning-rate schedule: linear warmup over `warmup_steps`, then `lr_scheduler`
    (run/optimizers.py): cosine or linear decay to min_lr_ratio·lr, constant, or wsd (stable, then a linear
    decay to min_lr_ratio·lr over the last `decay_fraction` of the steps).

    `warmup_steps` not given (None): the default, 30 (a task preset's own), capped at steps // 10 with a
    warning when the run is not longer (`TrainConfig.warmup_steps`); given, it must be below `steps`.

    `global_batch` sequences per optimizer step are split over the dp ranks and then into
    micro-batches of `micro_batch` sequences; gradient accumulation covers the rest.
    """

    steps: int = 200
    global_batch: int = 32
    micro_batch: int = 16
    warmup_steps: int | None = None  # None: the default (see above)
    lr_scheduler: LrScheduler = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd only

    def validate(self) -> None:
        positive(self, "steps", "global_batch", "micro_batch")
        check_choices(self)
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise UserError(f"schedule.warmup_steps={self.warmup_steps} must be >= 0 and below schedule.steps="
                            f"{self.steps}: give fewer warmup steps (--warmup-steps), or leave it out for the default")
        for name in ("min_lr_ratio", "decay_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"schedule.{name} must be in [0, 1], got {getattr(self, name)}")

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
        positive(self, "keep")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite exclude each other: continue the run or start it over, not both")


@dataclass
class LogConfig:
    """Run directory, evaluation cadence and progress display.

    `every`: a metrics record and a progress line every N steps (`log_every` is its old name, still
    read). `progress`: auto (a bar on a terminal, lines otherwise), bar, lines or off; true/false
    mean auto/off. `report_to`: experiment trackers (run/trackers.py; their names and libraries are
    checked in the run layer, run/config_checks.py).
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
        positive(self, "every")
        check_choices(self)


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
        positive(self, "nproc")
        if self.max_restarts < 0:
            raise UserError(f"launch.max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise UserError(f"launch.threads must be in [0, {MAX_THREADS}] (0 = cores / nproc), got {self.threads}")


@dataclass
class LoRAConfig:
    """LoRA adapters (parallel/model/lora.py): `r` > 0 adds trainable rank-r matrices to every linear
    layer whose module name ends in one of `targets` (e.g. ["wq", "wv"] for the built-in Llama,
    ["q_proj", "v_proj"] for a Hugging Face one) and freezes the rest of the model; their output is
    scaled by `alpha`/r and their input goes through dropout `dropout`. r = 0: no LoRA."""

    r: int = 0
    alpha: float = 16.0
    targets: list[str] = field(default_factory=list)
    dropout: float = 0.0

    def validate(self) -> None:
        if self.r < 0:
            raise UserError(f"lora.r must be >= 0 (0 = no LoRA), got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.r and not [t for t in self.targets if t.strip()]:
            raise UserError(f"lora.r={self.r} needs lora.targets: name the linear layers to adapt, e.g. "
                            '--lora-targets wq,wv (q_proj,v_proj for a Hugging Face model)')
        if self.r and self.alpha <= 0:
            raise UserError(f"lora.alpha must be > 0, got {self.alpha}")
