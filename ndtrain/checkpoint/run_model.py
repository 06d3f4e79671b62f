"""The model a run trains, and the model a finished run holds.

- `build_run_model`: the model its config names, seeded (models/build.py), then the `model.init_from`
  weights when given (init_from.py), then the `lora` adapters (`with_lora`); every process builds it
  whole, before any parallelism.
- `load_run`: a run directory's config and the weights of its newest verified checkpoint, in the
  single-process model: what `ndtrain generate` samples from and `ndtrain export` writes.

Models sit below this layer: it imports them, they never import a checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from ndtrain.checkpoint.init_from import load_init_weights
from ndtrain.checkpoint.store import load_model_weights, newest_verified
from ndtrain.config import LoRAConfig, ModelConfig, TrainConfig, load_config
from ndtrain.errors import UserError
from ndtrain.failures import reason
from ndtrain.models.build import build_seeded_model, model_label
from ndtrain.parallel.model.lora import apply_lora


def with_lora(model: nn.Module, cfg: LoRAConfig, seed: int) -> nn.Module:
    """`model` with the adapters `cfg` asks for (seeded by `seed` and each target's name), the rest frozen;
    `model` itself when `cfg.r` is 0."""
    return apply_lora(model, cfg.targets, cfg.r, cfg.alpha, cfg.dropout, seed) if cfg.r else model


def build_run_model(cfg: ModelConfig, seed: int, lora: LoRAConfig | None = None) -> nn.Module:
    """The run's model on the CPU, initialised from `seed` or loaded from `cfg.init_from`, with `lora`'s adapters.

    Building is a function of the config, its files and the seed alone, so a failure to build is a
    UserError (its traceback kept as the cause): retrying would fail the same way (ndtrain/failures.py)."""
    try:
        model = build_seeded_model(cfg, seed)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot build the model {model_label(cfg)} ({reason(e)}): fix the model folder or "
                        "choose another model") from e
    if cfg.init_from is not None:
        load_init_weights(model, Path(cfg.init_from))
    return with_lora(model, lora or LoRAConfig(), seed)


def load_run(run_dir: Path) -> tuple[TrainConfig, nn.Module, Path]:
    """The config and final weights of a run directory (its newest verified checkpoint, also
    returned), as a single-process model in eval mode."""
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise UserError(f"{str(run_dir)!r} is not an ndtrain run directory (no config.toml): give the --out of a run")
    cfg = load_config(config_file)
    checkpoint = newest_verified(run_dir / "checkpoints")
    if checkpoint is None:
        raise UserError(f"run directory {str(run_dir)!r} has no checkpoint yet: train it first")
    model = build_seeded_model(dataclasses.replace(cfg.model, init_from=None), cfg.seed)  # the checkpoint overwrites it
    model = with_lora(model, cfg.lora, cfg.seed)
    load_model_weights(checkpoint, model)
    return cfg, model.eval(), checkpoint
