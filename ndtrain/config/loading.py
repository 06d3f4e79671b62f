"""A `TrainConfig` from TOML and `--set key=value` overrides, and back to TOML.

Resolution order: defaults → preset (presets.py) → TOML file → command-line flags and `--set key=value`.
Unknown keys and wrong types raise `UserError` naming the key and the fix (and the file, for a value of
a config file: each is checked before the flags override it); no float key takes nan or inf, no integer
key more than 64 bits. A config file is opened only when it is a regular file (a FIFO
would block) and read only as UTF-8 TOML (tomllib; the tomli backport on Python 3.10); the resolved
config is written with tomli-w.

`load_config` builds and validates what the config alone decides. The config a run uses also depends
on what it names outside itself (an `hf:PATH` model's config.json, an `hf:` tokenizer, the trackers'
libraries): `ndtrain.run.config_checks.resolve_config` completes and checks those on the same raw dict.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import stat
import sys
import types
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from ndtrain.config.options import values
from ndtrain.config.presets import apply_presets
from ndtrain.config.train import TrainConfig
from ndtrain.errors import UserError

INT64_MAX = 2**63 - 1


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Build a validated `TrainConfig` from an optional TOML file and dotted-key overrides."""
    cfg = config_from_dict(raw_config(path, overrides))
    cfg.validate()
    return cfg


def raw_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The TOML file at `path` (none: empty) as a nested dict, with dotted-key overrides set into it."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(path)
        check_file_values(raw, str(path))
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    return raw


def check_file_values(raw: dict[str, Any], name: str) -> None:
    """Every key and value of a config file, checked alone (names, types, presets) before any flag or
    `--set` overrides it: a wrong value in a file is an error even where a flag would replace it.
    Checks across keys are left to the resolved config, which the overrides complete."""
    try:
        config_from_dict(copy.deepcopy(raw))
    except UserError as e:
        raise UserError(f"config file {name!r}: {e}") from None


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
    """Typed config from a nested dict (not validated); a preset is applied before explicit keys."""
    raw = apply_presets({k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()})
    log_raw = raw.get("log")
    if isinstance(log_raw, dict) and "log_every" in log_raw:  # the old name of log.every
        if "every" in log_raw:
            raise UserError("log.log_every is the old name of log.every: give only log.every")
        log_raw["every"] = log_raw.pop("log_every")
    return _build(TrainConfig, raw, prefix="")


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


def dump_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config. TOML has no null:
    a key whose value is None is left out, and reads back as its default (None). tomli_w is imported
    here, by the one function that writes TOML: `make gpu-check` runs from the tree on a machine whose
    Python has torch but not tomli_w, and needs no run directory."""
    import tomli_w

    return tomli_w.dumps(_without_none(cfg.to_dict()))


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


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
    # an options Literal is checked here for its values' type; `check_choices` (validate) checks the value
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
