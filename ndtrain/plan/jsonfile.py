"""Reading the JSON files the planner is given (a CPU profile, a bench result): one error style.

Only regular files are opened (a FIFO or device is refused by its type, never read)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ndtrain.errors import UserError


def read(path: Path, flag: str, kind: str, key: str, value: str, fix: str) -> dict[str, Any]:
    """The JSON object at `path`, which must have data[key] == value (what makes it a `kind`);
    otherwise a one-line UserError naming `flag`, the problem and `fix`."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: a FIFO would block
            raise UserError(f"{flag} {path} is not a regular file: {fix}")
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, a NUL in the path
        raise UserError(f"{flag} {path}: cannot read {kind} ({e}); {fix}") from None
    if not isinstance(data, dict) or data.get(key) != value:
        raise UserError(f"{flag} {path} is not {kind}: {fix}")
    return data
