"""The run's optimizer and learning-rate schedule, from its config, on torch's own classes.

`optimizer_factory(cfg)`: the `OptimizerFn` every engine builds its optimizer with (from the
parameter groups its strategy hands it: whole parameters, ZeRO's flat segments, a server's shard):
- adamw: `torch.optim.AdamW(lr, betas=(beta1, beta2), eps, weight_decay)`;
- sgd: `torch.optim.SGD(lr, momentum, weight_decay)` (L2, as torch defines it);
- adafactor: `torch.optim.Adafactor(lr, weight_decay)`, torch's beta2_decay and eps.
AdamW and SGD are element-wise, so any layout gives the single-process result; Adafactor's factored
second moments need whole parameters (refused elsewhere: `TrainConfig.validate`).
`lr` is the peak rate (`optim.scaled_lr`); the group's options (no decay on vectors) override it.

`lr_multiplier(step, warmup, total, min_ratio, scheduler, decay_fraction)`: what `LambdaLR` multiplies
the peak by at 0-based step `step`: (step + 1) / warmup during the warmup, then
- cosine: 0.5·(1 + cos(π·p)) from 1 to min_ratio, p = (step − warmup) / (total − warmup) (min_ratio
  is reached at step `total`, one past the last);
- linear: from 1 at step `warmup` to min_ratio at the last step, total − 1;
- constant: 1;
- wsd: 1, then from 1 to min_ratio at the last step over the last ⌈decay_fraction·total⌉ steps
  (never before the warmup ends).
Cost: one torch optimizer's state (AdamW 8Ψ bytes, SGD 4Ψ with momentum, Adafactor about 4·(rows +
columns) per matrix); the multiplier is a few float operations per step. Nothing here communicates.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ndtrain.config import TrainConfig
from ndtrain.parallel.data.param_groups import OptimizerFn


def optimizer_factory(cfg: TrainConfig) -> OptimizerFn:
    """`groups -> optimizer` of `cfg.optim.name` at the run's peak learning rate."""
    o = cfg.optim
    lr = o.scaled_lr(cfg.schedule.global_batch)
    if o.name == "sgd":
        return lambda groups: torch.optim.SGD(groups, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "adafactor":
        return lambda groups: torch.optim.Adafactor(groups, lr=lr, weight_decay=o.weight_decay)
    return lambda groups: torch.optim.AdamW(
        groups, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float, scheduler: str = "cosine",
                  decay_fraction: float = 0.2) -> float:
    """The schedule's multiplier of the peak learning rate at 0-based `step` (see the module docstring)."""
    if step < warmup:
        return (step + 1) / warmup
    if scheduler == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if scheduler == "constant":
        return 1.0
    start = warmup if scheduler == "linear" else max(warmup, total - math.ceil(decay_fraction * total))
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, total - 1 - start))
    return 1.0 - (1.0 - min_ratio) * progress


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """The run's multiplier as a function of the step, for `torch.optim.lr_scheduler.LambdaLR`."""
    s, warmup = cfg.schedule, cfg.warmup_steps()
    return lambda step: lr_multiplier(step, warmup, s.steps, s.min_lr_ratio, s.lr_scheduler, s.decay_fraction)


def describe(cfg: TrainConfig) -> str:
    """The run description's line: `optimizer adamw; lr schedule cosine, warmup 30 of 200 steps, min 0.1·lr`."""
    o, s = cfg.optim, cfg.schedule
    options = {"adamw": f"betas ({o.beta1:g}, {o.beta2:g}), eps {o.eps:g}", "sgd": f"momentum {o.momentum:g}",
               "adafactor": "torch's beta2_decay and eps"}[o.name]
    tail = {"cosine": f"cosine to {s.min_lr_ratio:g}·lr", "linear": f"linear to {s.min_lr_ratio:g}·lr",
            "constant": "constant",
            "wsd": f"wsd (decay over the last {s.decay_fraction:g} of the steps to {s.min_lr_ratio:g}·lr)"}[s.lr_scheduler]
    return (f"optimizer {o.name} ({options}, weight decay {o.weight_decay:g} on matrices); "
            f"lr schedule: warmup {cfg.warmup_steps()} of {s.steps} steps, then {tail}")
