"""The model a run's `ModelConfig` names, freshly initialised: the built-in Llama, an `hf:PATH` model or a
task's own model (`digits`: the net `model.digits_net` names, models/digits_cnn.py; `model.dim` its
embedding size).
Built whole in every process (before any parallelism), from the run's seed, so every layout starts
from the same weights. A run's `model.init_from` weights are loaded on top by the checkpoint layer
(checkpoint/run_model.py), which imports this module, never the reverse."""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.models.digits_cnn import DIGITS_NETS, build_digits_net
from ndtrain.models.hf import build_hf_model, build_meta_hf_model, hf_model_type, hf_path, is_hf_model
from ndtrain.models.llama import Llama, build_model


def build_seeded_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model `cfg.preset` names on the CPU, initialised from `seed` (an `hf:PATH` model's own
    weights when its folder holds some); `cfg.init_from` is not read here."""
    if cfg.preset == "digits":
        return build_digits_net(cfg.digits_net, cfg.dim, seed)
    return build_hf_model(hf_path(cfg.preset), seed, cfg.attention) if is_hf_model(cfg.preset) else build_model(cfg, seed)


def build_meta_model(cfg: ModelConfig) -> nn.Module:
    """The model `cfg.preset` names on the meta device: the modules and shapes `build_seeded_model` gives,
    without memory, initialisation or reading any weights (what the launcher checks a layout against)."""
    if is_hf_model(cfg.preset):
        return build_meta_hf_model(hf_path(cfg.preset), cfg.attention)
    with torch.device("meta"):
        return DIGITS_NETS[cfg.digits_net](cfg.dim) if cfg.preset == "digits" else Llama(cfg)


def model_label(cfg: ModelConfig) -> str:
    """How messages name the model: the preset, `digits (its model.digits_net)` or `hf:PATH (model_type)`."""
    if cfg.preset == "digits":
        return f"digits ({cfg.digits_net})"
    return f"{cfg.preset} ({hf_model_type(hf_path(cfg.preset))})" if is_hf_model(cfg.preset) else cfg.preset
