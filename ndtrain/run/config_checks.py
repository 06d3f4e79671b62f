"""The config a run uses: `ndtrain.config` completed and checked against what it names outside itself.

The config package types and checks its own values and imports no layer above it. What a config
names elsewhere is resolved and checked here, in the run layer, which owns both sides:
- an `hf:PATH` model (models/hf.py): its sizes, vocabulary and tying come from PATH/config.json, the
  path made absolute (so a run directory's config.toml stays valid from anywhere); explicit model keys
  may only repeat them, and model.seq_len may not exceed the model's positions;
- an `hf:` tokenizer (data/tokenizer.py): model.vocab_size, when not given, is its vocabulary, and may
  not be smaller;
- `log.report_to` (run/trackers.py): known trackers whose libraries are installed;
- the parameter count of an `hf:PATH` model, from a construction on the meta device.

`resolve_config` is `ndtrain.config.load_config` with these, in the order the config reads them: the
HF model's sizes before the config is built, its positions after, the rest after the config's own
checks. `ndtrain train` (cli/commands.py) runs it in the launching process, before anything is
written; each worker runs it again on the same command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ndtrain.config import (
    ModelConfig, TrainConfig, check_vocab_size, config_from_dict, is_hf_preset, raw_config,
)
from ndtrain.data.tokenizer import tokenizer_vocab_size
from ndtrain.errors import UserError
from ndtrain.models import hf
from ndtrain.run.trackers import check_trackers


def resolve_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A validated `TrainConfig` from an optional TOML file and dotted-key overrides, with what its
    `hf:PATH` model and its tokenizer decide filled in, and every check across layers made."""
    cfg = resolve_config_dict(raw_config(path, overrides))
    cfg.validate()
    check_config(cfg)
    return cfg


def resolve_config_dict(raw: dict[str, Any]) -> TrainConfig:
    """Typed config from a nested dict (not validated): `config_from_dict` with an `hf:PATH` model's
    sizes from its config.json, or else the vocabulary of a tokenizer other than bytes."""
    model_raw = raw.get("model", {})
    preset = model_raw.get("preset") if isinstance(model_raw, dict) else None
    if is_hf_preset(preset):
        table, path = hf_model_table(preset, model_raw)
        cfg = config_from_dict({**raw, "model": table})
        hf.check_seq_len(path, cfg.model.seq_len)
        return cfg
    cfg = config_from_dict(raw)
    if "vocab_size" not in model_raw and cfg.data.tokenizer != "bytes":
        cfg.model.vocab_size = tokenizer_vocab_size(cfg.data.tokenizer)  # not given: the tokenizer's
    return cfg


def hf_model_table(preset: str, model_raw: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """The model table of an `hf:PATH` preset: sizes from PATH/config.json (the path made absolute,
    so the run directory's config.toml stays valid from anywhere); explicit keys may only repeat them."""
    path = hf.hf_path(preset).expanduser().resolve()
    sizes = hf.config_sizes(path)
    for key, value in model_raw.items():
        if key in sizes and key != "seq_len" and value != sizes[key]:
            raise UserError(
                f"model.{key}={value!r} differs from {sizes[key]!r} in {str(path / 'config.json')!r}: "
                f"the HF config decides the model's sizes; drop model.{key}"
            )
    return {**model_raw, **{k: v for k, v in sizes.items() if k not in model_raw or k != "seq_len"},
            "preset": f"hf:{path}"}, path


def check_config(cfg: TrainConfig) -> None:
    """The checks of a validated config against the layers it names: trackers, then the tokenizer's vocabulary."""
    check_trackers(cfg.log.report_to)
    if cfg.data.tokenizer != "bytes":  # the byte tokenizer's is checked by TrainConfig.validate
        check_vocab_size(cfg.model.vocab_size, cfg.data.tokenizer, tokenizer_vocab_size(cfg.data.tokenizer))


def parameter_count(model: ModelConfig) -> int:
    """Ψ of the model `model` names: an `hf:PATH` model counted on a meta-device construction, the
    built-in Llama by arithmetic (`ModelConfig.parameter_count`)."""
    if is_hf_preset(model.preset):
        return hf.parameter_count(hf.hf_path(model.preset))
    return model.parameter_count()
