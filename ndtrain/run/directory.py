"""A run directory is ndtrain's or untouched: the marker that says a folder is one of our runs.

`ndtrain train --out DIR` writes into DIR only when DIR is new, empty, or already a run directory of
ours. Ours means DIR holds the marker file `.ndtrain-run` (JSON: the ndtrain version and time that
claimed it), which the launcher writes before the first other byte; a run directory written before
the marker existed is recognised by a finished checkpoint with an ndtrain manifest under
`checkpoints/` (and gets its marker on the next run). Any other non-empty folder — another
program's files, even with the same names as ours (`config.toml`, `metrics.jsonl`, `data/`) — is
refused in one line before anything is written, with `--resume` and `--overwrite` as well.

`check_owned` reads only; `claim` checks, then creates the folder and writes the marker; `claimed`
also takes back what a refused start added. Nothing here communicates.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from ndtrain.checkpoint.manifest import MANIFEST, step_dirs
from ndtrain.errors import UserError
from ndtrain.run.info import utc_now
from ndtrain.version import package_version

MARKER = ".ndtrain-run"
SHOWN = 3  # entries a refusal names


def is_owned(run_dir: Path) -> bool:
    """True when `run_dir` is missing, empty, marked as ours, or an unmarked run of ours with a checkpoint."""
    try:
        entries = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return True
    return not entries or MARKER in entries or has_checkpoint(run_dir)


def check_owned(run_dir: Path) -> None:
    """Refuse (UserError) a folder that is not empty and not a run directory of ours. Reads only."""
    if is_owned(run_dir):
        return
    entries = sorted(os.listdir(run_dir))
    shown = ", ".join(repr(name) for name in entries[:SHOWN]) + (", ..." if len(entries) > SHOWN else "")
    raise UserError(
        f"--out {str(run_dir)!r} is not an ndtrain run directory (it holds {shown} and no {MARKER} marker): "
        "ndtrain writes only into a new or empty folder or one of its own runs; give another --out"
    )


def claim(run_dir: Path) -> None:
    """Make `run_dir` a run directory of ours: refuse a foreign folder, else create it and write the marker."""
    check_owned(run_dir)
    marker = run_dir / MARKER
    if marker.exists():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir / f"{MARKER}.partial"
    partial.write_text(json.dumps({"ndtrain": package_version(), "claimed": utc_now()}) + "\n")
    partial.replace(marker)


@contextlib.contextmanager
def claimed(run_dir: Path, write: bool = True) -> Iterator[None]:
    """`claim(run_dir)` (when `write`), then the caller's first writes; a UserError among them removes
    every entry the claim and those writes added (the folder too when it was new), so a refused run
    leaves nothing behind. Only entries that were not there before are removed: all of them ours."""
    if not write:
        yield
        return
    new = not run_dir.exists()
    before = set() if new else set(os.listdir(run_dir))
    claim(run_dir)
    try:
        yield
    except UserError:
        if new:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            for name in set(os.listdir(run_dir)) - before:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        raise


def has_checkpoint(run_dir: Path) -> bool:
    """A finished checkpoint directory (with its manifest) exists: what `--resume` needs (verified on load)."""
    return any((step / MANIFEST).is_file() for step in step_dirs(run_dir / "checkpoints"))


def nothing_to_resume(checkpoints: Path) -> UserError:
    """The refusal of `--resume` where no checkpoint exists (the launcher's early check and the trainer's)."""
    return UserError(f"--resume: no checkpoint in {str(checkpoints)!r}; drop --resume to start a new run")
