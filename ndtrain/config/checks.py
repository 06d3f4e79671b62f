"""Value checks the config sections share: each ends in one `UserError` line naming the key and the fix.

- `positive`: numbers that must be > 0;
- `exists`: whether a path names something (a path the OS cannot take does not);
- `check_choices`: a field annotated with an options `Literal` (options.py) holds one of its values;
- `check_vocab_size`: the model's vocabulary covers the tokenizer's (the byte tokenizer's here, in
  `TrainConfig.validate`; an `hf:` tokenizer's in the run layer, `ndtrain/run/config_checks.py`).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from ndtrain.config.options import literal_in, values
from ndtrain.errors import UserError


def positive(section: Any, *names: str) -> None:
    """Every field `names` of `section` is > 0."""
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise UserError(f"{section_name(section)}.{name} must be > 0, got {value}")


def exists(path: str) -> bool:
    """Whether `path` names something; a name the OS cannot take (NUL byte, too long) does not."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def check_choices(section: Any) -> None:
    """Every field of `section` annotated with an options Literal holds one of its values."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        option = literal_in(hints[f.name])
        value = getattr(section, f.name)
        if option is not None and value not in values(option):
            allowed = ", ".join(str(v) for v in values(option))
            raise UserError(f"{section_name(section)}.{f.name}={value!r} is not one of {allowed}")


def check_vocab_size(vocab_size: int, tokenizer: str, tokens: int) -> None:
    """`model.vocab_size` must hold the `tokens` ids of `data.tokenizer` (a model alone may have any vocabulary)."""
    if vocab_size < tokens:
        whose = (f"the byte tokenizer's {tokens} tokens" if tokenizer == "bytes"
                 else f"the {tokens} tokens of data.tokenizer={tokenizer!r}")
        raise UserError(
            f"model.vocab_size={vocab_size} is smaller than {whose}: "
            f"use model.vocab_size >= {tokens}, or leave it out to take the tokenizer's"
        )


def section_name(section: Any) -> str:
    """The TOML table of a section object: `ParallelConfig` → `parallel`."""
    return type(section).__name__.removesuffix("Config").lower()
