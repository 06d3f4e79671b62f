"""Is the run directory one folder for every rank? Checked once at start, before training.

Ranks on several hosts write their checkpoint slices, logs and metrics into RUN_DIR and read the
token file rank 0 built there, so RUN_DIR must be one shared file system (NFS, Lustre, ...) seen
by every host. Rank 0 writes a fresh random token into RUN_DIR/logs/.shared-TOKEN and broadcasts the
token; every rank opens that file by name and compares its content; an all-reduce of one flag per
rank tells every rank which ranks did not find it, and all of them then raise the same one-line
UserError naming those ranks (exit status 2: a restart would meet it again). Rank 0 removes the
file afterwards (and any a killed run left). One process: nothing to check.

Cost: one 8-byte broadcast and one all-reduce of world_size int64 on the world group, one small file
written, read by every rank and removed, once per start.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import torch

from ndtrain.console import LOGS_DIR
from ndtrain.dist.mesh import ParallelContext
from ndtrain.errors import UserError

PREFIX = ".shared-"


def _token_path(run_dir: Path, token: int) -> Path:
    return run_dir / LOGS_DIR / f"{PREFIX}{token:016x}"


def check_shared_run_dir(run_dir: Path, ctx: ParallelContext) -> None:
    """Every rank sees the file rank 0 wrote into `run_dir`, or every rank raises the same UserError
    (collective on the world group)."""
    if ctx.world_size == 1:
        return
    world = ctx.group("world")
    token = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    if ctx.is_main:
        for stale in (run_dir / LOGS_DIR).glob(PREFIX + "*"):
            stale.unlink(missing_ok=True)
        token[0] = secrets.randbits(63)
        path = _token_path(run_dir, int(token.item()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{int(token.item()):016x}\n")
    ctx.comm.broadcast(token, world)
    path = _token_path(run_dir, int(token.item()))
    try:
        seen = path.read_text().strip() == f"{int(token.item()):016x}"
    except OSError:
        seen = False
    missing = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    missing[ctx.rank] = int(not seen)
    ctx.comm.all_reduce(missing, world)
    if ctx.is_main:
        path.unlink(missing_ok=True)
    blind = [rank for rank, flag in enumerate(missing.tolist()) if flag]
    if blind:
        raise UserError(
            f"ranks {blind} do not see the run directory {str(run_dir)!r} rank 0 writes (the file {path.name} it "
            "wrote there is missing for them): put --out on a file system every host mounts at the same path"
        )
