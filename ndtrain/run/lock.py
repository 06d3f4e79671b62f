"""One live run per run directory: rank 0 holds an exclusive `flock` on RUN_DIR/.lock.

Only in a run directory of ours (run/directory.py): a foreign folder is refused before the lock
file is created in it.

Rank 0 takes the lock before anything is written and writes its PID into the file; the result
(0, or the holder's PID) is broadcast so that every rank of a refused run stops with the same
one-line UserError (exit status 2) and writes nothing. The kernel drops the lock when the holding
process ends, however it ends (SIGKILL included), so an elastic restart or a re-run after a crash
is never blocked by a dead run. Cost: one 8-byte broadcast at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import torch

from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.run.directory import check_owned, is_owned

LOCK_NAME = ".lock"
UNKNOWN_HOLDER = -1  # the holder has not written its PID yet
UNWRITABLE = -2      # the lock file cannot be created
FOREIGN = -3         # the run directory is another program's folder (run/directory.py)


def _try_lock(path: Path) -> tuple[int | None, int]:
    """(open descriptor, 0) when this process now holds the lock; (None, holder PID or code) otherwise."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None, UNWRITABLE
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        return None, int(text) if text.isdigit() else UNKNOWN_HOLDER
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, 0


def _in_use(run_dir: Path, holder: int) -> UserError:
    who = f"process {holder}" if holder != UNKNOWN_HOLDER else "another process"
    return UserError(
        f"run directory {str(run_dir)!r} is in use by {who} (lock {str(Path(run_dir) / LOCK_NAME)!r}): "
        f"wait for that run to end, or use another --out"
    )


def refuse_if_locked(run_dir: Path) -> None:
    """The launcher's early check (before it writes the token file): a live run's lock refuses this run
    with the workers' message. Reads only; a missing lock file passes (the workers take the lock)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        raise _in_use(run_dir, int(text) if text.isdigit() else UNKNOWN_HOLDER) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def run_lock(run_dir: Path, ctx: ParallelContext) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the duration (collective: every rank enters it)."""
    path = Path(run_dir) / LOCK_NAME
    foreign = ctx.is_main and not is_owned(Path(run_dir))  # the launcher claimed it; a direct worker start may not have
    fd, holder = (None, FOREIGN) if foreign else _try_lock(path) if ctx.is_main else (None, 0)
    refused = torch.tensor([holder], dtype=torch.int64, device=ctx.device)
    ctx.comm.broadcast(refused, ctx.group("world"))
    holder = int(refused.item())
    if holder == FOREIGN:
        if ctx.is_main:
            check_owned(Path(run_dir))  # raises, naming what the folder holds
        raise UserError(f"--out {str(run_dir)!r} is not an ndtrain run directory: give another --out")
    if holder == UNWRITABLE:
        raise UserError(f"cannot create the run lock {str(path)!r}: use a writable --out directory")
    if holder:
        raise _in_use(run_dir, holder)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
