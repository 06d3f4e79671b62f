"""The model a run trains, from its `ModelConfig`: the built-in Llama or an `hf:PATH` model, then
the `model.init_from` weights when given. Built whole in every process (before any parallelism),
from the run's seed, so every layout starts from the same weights."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.models.hf import build_hf_model, hf_model_type, hf_path, is_hf_model
from ndtrain.models.llama import build_model


def build_run_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The run's model on the CPU, initialised from `seed` or loaded from `cfg.init_from`."""
    model = build_hf_model(hf_path(cfg.preset), seed) if is_hf_model(cfg.preset) else build_model(cfg, seed)
    if cfg.init_from is not None:
        from ndtrain.checkpoint.init_from import load_init_weights

        load_init_weights(model, Path(cfg.init_from))
    return model


def model_label(cfg: ModelConfig) -> str:
    """How messages name the model: the preset, or `hf:PATH (model_type)`."""
    return f"{cfg.preset} ({hf_model_type(hf_path(cfg.preset))})" if is_hf_model(cfg.preset) else cfg.preset
