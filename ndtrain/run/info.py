"""Facts about a run that make its records traceable: wall-clock stamps, elapsed time, versions, host, git.

`RunClock` gives each metrics record its `time` (ISO 8601 UTC, millisecond precision, e.g.
"2026-11-23T12:40:01.123+00:00") and `elapsed_s`: seconds of training since the run first
started, summed over its starts (a resumed run continues from the `elapsed_s` of the last record
it keeps; the seconds between that record and the interruption, and the time to start the
processes and load a checkpoint, are not counted). `environment()` names the ndtrain, torch and
Python versions, the host, and the git commit of the ndtrain source tree when that is a git
checkout (git runs with a short timeout; no git, no checkout or a slow git gives `null`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

GIT_TIMEOUT_S = 5.0
SOURCE_DIR = Path(__file__).resolve().parent


def utc_now() -> str:
    """The current time as ISO 8601 UTC with milliseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class RunClock:
    """Elapsed seconds of one run across its starts: `offset_s` from earlier starts plus this one's."""

    def __init__(self, offset_s: float = 0.0) -> None:
        self.offset_s = offset_s
        self.started = utc_now()
        self._t0 = time.monotonic()

    def elapsed_s(self) -> float:
        return self.offset_s + time.monotonic() - self._t0

    def stamp(self) -> dict[str, Any]:
        return {"time": utc_now(), "elapsed_s": round(self.elapsed_s(), 3)}


def ndtrain_version() -> str | None:
    try:
        return importlib.metadata.version("ndtrain")
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(directory: Path, *args: str) -> str | None:
    """stdout of `git -C directory ARGS`, or None when git is missing, fails or takes too long."""
    try:
        proc = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_revision(directory: Path = SOURCE_DIR) -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} when `directory`'s own files are tracked in a git checkout, else None.

    The check that `__init__.py` is tracked keeps an installed copy inside some other repository
    (a virtual environment in a project folder) from reporting that repository's commit.
    `dirty`: tracked files differ from the commit (untracked files do not count, as `git describe --dirty`).
    """
    if _git(directory, "ls-files", "--error-unmatch", "__init__.py") is None:
        return None
    commit = _git(directory, "rev-parse", "HEAD")
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    if not commit or status is None:
        return None
    return {"commit": commit, "dirty": bool(status)}


def environment() -> dict[str, Any]:
    """Versions, host and git revision of the code that ran."""
    return {
        "ndtrain_version": ndtrain_version(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": socket.gethostname(),
        "git": git_revision(),
    }
