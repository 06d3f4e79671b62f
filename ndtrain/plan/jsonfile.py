"""Reading the JSON files the planner is given (a CPU profile, a bench result): one error style."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ndtrain.errors import UserError


def read(path: Path, flag: str, kind: str, key: str, value: str, fix: str) -> dict[str, Any]:
    """The JSON object at `path`, which must have data[key] == value (what makes it a `kind`);
    otherwise a one-line UserError naming `flag`, the problem and `fix`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read {kind} ({e}); {fix}")
    if not isinstance(data, dict) or data.get(key) != value:
        raise UserError(f"{flag} {path} is not {kind}: {fix}")
    return data
