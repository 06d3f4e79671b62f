"""`TrainConfig`: the whole run configuration, one field per section, and the checks across sections
that the config alone can make. Checks that need a model, a tokenizer or a tracker library live in
the run layer (`ndtrain/run/config_checks.py`).

`allowed_values` reads a dotted key's allowed values from its annotation (the command line's choices).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from ndtrain.config.checks import check_vocab_size
from ndtrain.config.options import literal_in, values
from ndtrain.config.parallel import ParallelConfig, PSConfig
from ndtrain.config.presets import TASK_PRESETS, default_warmup_steps
from ndtrain.config.sections import (
    CheckpointConfig, DataConfig, LaunchConfig, LogConfig, LoRAConfig, ModelConfig, OptimConfig, ScheduleConfig,
)
from ndtrain.errors import UserError

BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (data/tokenizer.py), the least a model can have


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
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        """Every section's own checks, then those across sections (the byte tokenizer's vocabulary
        included; an `hf:` tokenizer's is checked in the run layer)."""
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
        if self.ps.servers and (p.sync_batchnorm or p.broadcast_buffers):
            raise UserError(
                "parallel.sync_batchnorm and parallel.broadcast_buffers act over the data-parallel group, which the "
                "parameter server's workers do not form: set them false, or ps.servers=0"
            )
        if p.overlap_optimizer and (self.optim.grad_clip > 0 or self.optim.skip_nonfinite or p.precision == "fp16"):
            raise UserError(
                "parallel.overlap_optimizer=true updates parameters during backward, before the global gradient norm "
                "exists: set optim.grad_clip=0 and optim.skip_nonfinite=false (and no fp16), or overlap_optimizer=false"
            )
        if self.data.tokenizer == "bytes":
            check_vocab_size(self.model.vocab_size, self.data.tokenizer, BYTE_VOCAB)
        self._check_optimizer()
        self._check_lora()

    def _check_optimizer(self) -> None:
        """Refuse the layouts an optimizer does not give the single-process result under, in one line."""
        p, name = self.parallel, self.optim.name
        if name == "adafactor" and (p.zero > 0 or p.tp > 1):
            where = f"parallel.zero={p.zero} splits them into flat shards" if p.zero > 0 else f"parallel.tp={p.tp} splits matrices"
            raise UserError(f"optim.name=adafactor keeps factored (row and column) second moments of whole matrices, but "
                            f"{where}: use zero=0 and tp=1 (dp, pp, cp and the parameter server keep parameters whole), "
                            "or optim.name=adamw or sgd")
        levers = [f"parallel.{lever}=true" for lever in ("flat_adamw", "overlap_optimizer") if getattr(p, lever)]
        if name != "adamw" and levers:
            raise UserError(f"{levers[0]} replaces AdamW's update and does nothing with optim.name={name}: "
                            "set it false, or optim.name=adamw")

    def _check_lora(self) -> None:
        """Refuse, in one line, the layouts LoRA's frozen base is not kept out of gradients and optimizer under."""
        lora, p = self.lora, self.parallel
        if not lora.r:
            return
        unsupported = [what for what, on in (
            (f"parallel.precision={p.precision} with zero={p.zero} (fp32 masters of the frozen base; zero=3 "
             "keeps none)", p.precision != "fp32" and p.zero < 3),
            (f"lora.dropout={lora.dropout} with tp={p.tp} (the tp ranks would draw different masks)",
             lora.dropout > 0 and p.tp > 1),
            (f"ps.servers={self.ps.servers}", self.ps.servers > 0),
            (f"parallel.dp_mode={p.dp_mode}", p.dp_mode != "ddp"),
            ("parallel.flat_adamw=true", p.flat_adamw),
        ) if on]
        if unsupported:
            raise UserError(f"lora.r={lora.r} does not combine with {unsupported[0]}: change it or set lora.r=0")

    def warmup_steps(self) -> int:
        """The run's warmup: `schedule.warmup_steps` when given, else the default (`default_warmup_steps`),
        capped at steps // 10 when it is not below `schedule.steps` (`warmup_warning` says so)."""
        s = self.schedule
        if s.warmup_steps is not None:
            return s.warmup_steps
        default = default_warmup_steps(self.model.preset)
        return default if default < s.steps else s.steps // 10

    def warmup_warning(self) -> str | None:
        """The one line saying the default warmup was capped (None: it was not)."""
        s = self.schedule
        default = default_warmup_steps(self.model.preset)
        if s.warmup_steps is not None or default < s.steps:
            return None
        return (f"the default warmup of {default} steps is not below schedule.steps={s.steps}: warming up over "
                f"{self.warmup_steps()} steps (steps // 10) instead; give --warmup-steps N (< {s.steps}) to choose")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def allowed_values(key: str) -> tuple[Any, ...] | None:
    """The values a dotted config key (`parallel.precision`) is limited to, from its annotation; None for an open key."""
    section: Any = TrainConfig
    *parents, name = key.split(".")
    for part in parents:
        section = typing.get_type_hints(section)[part]
    option = literal_in(typing.get_type_hints(section)[name])
    return None if option is None else values(option)
