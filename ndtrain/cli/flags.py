"""Flag conventions shared by `ndtrain train`, `plan` and `bench`: one spelling, one set of allowed values.

- Booleans are `true|false` everywhere (`parse_bool`; 1/0, yes/no and on/off are read too).
- Closed sets (precision, recompute, schedule, dp mode, ZeRO stage, PS mode: the `Literal` types of
  config/options.py) are the values of the annotation of the config key a flag sets, the same the config
  validates with, handed to argparse as `choices`, so the parser refuses anything else with one line
  and `--help` lists them; the model preset is checked by `parse_model`.
- Every option's help ends with its default: `train` flags show the config default of their key
  (read from the config dataclasses), the other commands their argparse default (`HelpFormatter`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ndtrain.config import HF_PREFIX, MODEL_PRESETS, PRESET_NAMES, TrainConfig, allowed_values, read_toml

BOOL_METAVAR = "{true,false}"
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NUMBER_METAVARS: dict[Callable[[str], Any], str] = {int: "N", float: "X"}


def parse_bool(text: str) -> bool:
    """`true` or `false` (any case; also 1/0, yes/no, on/off); anything else is a usage error."""
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_names(text: str) -> list[str]:
    """A comma-separated list of names (`wq,wv`), blanks dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


MODEL_METAVAR = "{" + ",".join(PRESET_NAMES) + ",hf:PATH}"


def parse_model(text: str) -> str:
    """A built-in preset name or `hf:PATH` (a folder with a transformers config.json, checked by the config)."""
    if text in PRESET_NAMES or (text.startswith(HF_PREFIX) and len(text) > len(HF_PREFIX)):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(PRESET_NAMES)} or hf:PATH)")


def value_options(key: str, kind: Callable[[str], Any]) -> dict[str, Any]:
    """argparse keywords giving a flag for config `key` its type, allowed values and metavar."""
    if key == "model.preset":
        return {"type": parse_model, "metavar": MODEL_METAVAR}
    if kind is parse_bool:
        return {"type": parse_bool, "metavar": BOOL_METAVAR}
    if kind is parse_names:
        return {"type": parse_names, "metavar": "NAME[,NAME...]"}
    choices = allowed_values(key)
    if choices is None and kind in NUMBER_METAVARS:
        return {"type": kind, "metavar": NUMBER_METAVARS[kind]}
    return {"type": kind, "choices": choices}


def config_default(key: str) -> Any:
    """The default of a dotted config key, read from the config dataclasses (`TrainConfig()`)."""
    node: Any = TrainConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def show_default(key: str) -> str:
    """`key`'s default as the help shows it; model sizes depend on the preset, which is said."""
    value = config_default(key)
    section, _, name = key.partition(".")
    if section == "model" and name in MODEL_PRESETS[config_default("model.preset")]:
        per_preset = ", ".join(f"{preset} {sizes[name]}" for preset, sizes in MODEL_PRESETS.items())
        return f"the preset's: {per_preset}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or value == "":
        return "none"
    return str(value)


def add_config_flag(parser: argparse.ArgumentParser, flag: str, key: str, kind: Callable[[str], Any],
                    help_text: str) -> None:
    """A flag that sets config `key` when given (argparse default None: the file or the config default
    applies), its help naming the key and the config default."""
    parser.add_argument(flag, dest=flag_dest(flag), default=None,
                        help=f"{help_text} [{key}] (default: {show_default(key)})", **value_options(key, kind))


def flag_dest(flag: str) -> str:
    """The namespace attribute of a config flag: `--dp-mode` → `dp_mode`, `--ps.servers` → `ps.servers`."""
    return flag.lstrip("-").replace("-", "_")


def preset_override_warning(config_path: str | None, overrides: dict[str, Any]) -> str | None:
    """When the command line picks a model preset and the config file sets sizes the preset also sets
    (config order: preset, then file), the one line saying which of the file's keys win; else None.
    Keys the command line sets itself (`--seq-len`, `--set model.dim=...`) win over both and are not named."""
    preset = overrides.get("model.preset")
    if config_path is None or preset not in MODEL_PRESETS:
        return None
    table = read_toml(config_path).get("model", {})
    if not isinstance(table, dict):
        return None
    keys = [f"model.{k}" for k in table if k in MODEL_PRESETS[preset] and f"model.{k}" not in overrides]
    if not keys:
        return None
    return (f"config file {config_path!r} sets {', '.join(keys)}: its values replace those of --model {preset} "
            f"(preset, then file, then flags); remove them from the file to get the preset's sizes")


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to every option that takes a value and has a default its help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text
