"""The config a run uses: `ndtrain.config` completed and checked against what it names outside itself.

The config package types and checks its own values and imports no layer above it. What a config
names elsewhere is resolved and checked here, in the run layer, which owns both sides:
- an `hf:PATH` model (models/hf.py): its sizes, vocabulary and tying come from PATH/config.json, and
  so do its norm epsilon, rotary base and init std where the family has them (`HF_VALUE_KEYS`), so the
  run's config.toml records the model's own values; the path is made absolute (a run directory's
  config.toml stays valid from anywhere); explicit model keys may only repeat them, and model.seq_len
  may not exceed the model's positions;
- the tokenizer of an `hf:PATH` model: when data.tokenizer is not given, PATH's own tokenizer if the
  folder has one (data/tokenizer.py `folder_tokenizer`: `hf:PATH`, or `bytes` for ndtrain's byte
  tokenizer exported with a model); an explicit data.tokenizer (`bytes` included) wins. A tokenizer
  with more ids than the model's embedding rows is refused;
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
from ndtrain.data.tokenizer import folder_tokenizer, tokenizer_vocab_size
from ndtrain.errors import UserError
from ndtrain.models import hf
from ndtrain.run.trackers import check_trackers

# ModelConfig field ← the config.json keys holding it (first present wins), besides the sizes hf.py reads;
# a family without the key (GPT-2 has no rotary positions) keeps ndtrain's default, which its model never reads
HF_VALUE_KEYS: dict[str, tuple[str, ...]] = {
    "norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon"),
    "rope_theta": ("rope_theta",),  # transformers 5 nests it in rope_parameters
    "init_std": ("initializer_range",),
}


def resolve_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A validated `TrainConfig` from an optional TOML file and dotted-key overrides, with what its
    `hf:PATH` model and its tokenizer decide filled in, and every check across layers made."""
    cfg = resolve_config_dict(raw_config(path, overrides))
    cfg.validate()
    check_config(cfg)
    return cfg


def resolve_config_dict(raw: dict[str, Any]) -> TrainConfig:
    """Typed config from a nested dict (not validated): `config_from_dict` with an `hf:PATH` model's
    sizes and values from its config.json and its own tokenizer unless data.tokenizer is given, or else
    the vocabulary of a tokenizer other than bytes."""
    model_raw = raw.get("model", {})
    preset = model_raw.get("preset") if isinstance(model_raw, dict) else None
    if is_hf_preset(preset):
        table, path = hf_model_table(preset, model_raw)
        cfg = config_from_dict({**with_model_tokenizer(raw, path), "model": table})
        hf.check_seq_len(path, cfg.model.seq_len)
        return cfg
    cfg = config_from_dict(raw)
    if "vocab_size" not in model_raw and cfg.data.tokenizer != "bytes":
        cfg.model.vocab_size = tokenizer_vocab_size(cfg.data.tokenizer)  # not given: the tokenizer's
    return cfg


def hf_model_table(preset: str, model_raw: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """The model table of an `hf:PATH` preset: sizes and `HF_VALUE_KEYS` values from PATH/config.json (the
    path made absolute, so the run directory's config.toml stays valid from anywhere); explicit keys may
    only repeat them."""
    path = hf.hf_path(preset).expanduser().resolve()
    sizes = {**hf.config_sizes(path), **hf_config_values(hf.read_hf_config(path))}
    for key, value in model_raw.items():
        if key in sizes and key != "seq_len" and value != sizes[key]:
            raise UserError(
                f"model.{key}={value!r} differs from {sizes[key]!r} in {str(path / 'config.json')!r}: "
                f"the HF config decides the model's sizes and values; drop model.{key}"
            )
    return {**model_raw, **{k: v for k, v in sizes.items() if k not in model_raw or k != "seq_len"},
            "preset": f"hf:{path}", "attention": hf.resolve_attention(path, model_raw.get("attention", "auto"))}, path


def hf_config_values(config: dict[str, Any]) -> dict[str, float]:
    """The ModelConfig values of `HF_VALUE_KEYS` that an HF config.json (as a dict) holds."""
    nested = config.get("rope_parameters")
    found = {**(nested if isinstance(nested, dict) else {}), **config}
    values = {}
    for field, keys in HF_VALUE_KEYS.items():
        value = next((found[k] for k in keys if _number(found.get(k))), None)
        if value is not None:
            values[field] = float(value)
    return values


def with_model_tokenizer(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """`raw` with data.tokenizer set to the model folder's own tokenizer when the config does not name one
    and the folder has one (`folder_tokenizer`)."""
    data_raw = raw.get("data", {})
    if not isinstance(data_raw, dict) or "tokenizer" in data_raw:
        return raw  # a data table that is not a table is config_from_dict's error to name
    spec = folder_tokenizer(path)
    return raw if spec is None else {**raw, "data": {**data_raw, "tokenizer": spec}}


def check_config(cfg: TrainConfig) -> None:
    """The checks of a validated config against the layers it names: trackers, then the tokenizer's vocabulary
    (against an `hf:PATH` model's embedding rows, which its config.json decides)."""
    check_trackers(cfg.log.report_to)
    if cfg.data.tokenizer == "bytes":  # checked by TrainConfig.validate
        return
    tokens = tokenizer_vocab_size(cfg.data.tokenizer)
    if is_hf_preset(cfg.model.preset) and cfg.model.vocab_size < tokens:
        rows, path = cfg.model.vocab_size, hf.hf_path(cfg.model.preset)
        own = folder_tokenizer(path)
        fix = f"give data.tokenizer one of at most {rows} tokens, or bytes"
        if own is not None and own != cfg.data.tokenizer:
            fix = f"leave data.tokenizer out to use the model's own ({own}), or {fix}"
        raise UserError(f"model.vocab_size={rows} is smaller than the {tokens} tokens of data.tokenizer="
                        f"{cfg.data.tokenizer!r}: the model in {str(path)!r} has {rows} embedding rows; {fix}")
    check_vocab_size(cfg.model.vocab_size, cfg.data.tokenizer, tokens)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parameter_count(model: ModelConfig) -> int:
    """Ψ of the model `model` names: an `hf:PATH` model counted on a meta-device construction, the
    built-in Llama by arithmetic (`ModelConfig.parameter_count`)."""
    if is_hf_preset(model.preset):
        return hf.parameter_count(hf.hf_path(model.preset))
    return model.parameter_count()
