"""How every rank ends a checkpoint save or load that failed somewhere: one agreement, one line.

A save runs in phases (`store.save_checkpoint`); each ends in `settle`, one all-reduce of
world × 3 int64 (failed, bytes this rank writes, what its failure recurs as) that is also the
phase's barrier. When a rank failed, the ranks' reasons are exchanged (`texts`: one all-reduce of
world × 1 KiB), rank 0 removes the `.partial` save and decides whether the failure recurs — a
UserError, a write the file system refused (ndtrain/failures.py's rule), or too little space for
the save once the partial one is gone — and then every rank raises that same one-line UserError
(naming the file system, the space needed and the newest verified checkpoint left), or its own
failure, or `PeerFailed` (the group restarts). `agree` makes one rank's load error every rank's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ndtrain.checkpoint.format import Piece
from ndtrain.checkpoint.manifest import PARTIAL, choose
from ndtrain.dist.mesh import ParallelContext
from ndtrain.errors import UserError
from ndtrain.failures import NO_SPACE, PeerFailed, free_bytes, mount_point, reason, size_text, write_refusal


@dataclass(frozen=True)
class PendingSave:
    """One checkpoint being written: where, under which name, and the pieces this rank writes."""

    directory: Path
    name: str
    pieces: list[Piece]

    @property
    def partial(self) -> Path:
        return self.directory / (self.name + PARTIAL)

    def bytes(self) -> int:
        return sum(piece.tensor.numel() * piece.tensor.element_size() for piece in self.pieces)


_USER, _NO_SPACE, _REFUSED = 1, 2, 3  # what a rank's failed phase recurs as (0: it may not recur)


def attempt(phase: Callable[[], None]) -> BaseException | None:
    """Run one phase of a save; what it raised (DCP raises `CheckpointException`, a BaseException)."""
    try:
        phase()
    except (Exception, CheckpointException) as e:
        return e
    return None


def _kind(failure: BaseException) -> int:
    if isinstance(failure, UserError):
        return _USER
    refused = write_refusal(failure)
    if refused is None:
        return 0
    return _NO_SPACE if refused.errno in NO_SPACE else _REFUSED


def settle(failure: BaseException | None, save: PendingSave, ctx: ParallelContext) -> None:
    """The end of a phase on every rank: one all-reduce of (failed, bytes written, kind) per rank, the
    save's barrier. When a rank failed: its reasons are exchanged, rank 0 removes the `.partial` save
    and decides whether the failure recurs (a UserError; a write the file system refused; or too little
    space left for the save once the partial one is gone, whatever the error said), then every rank
    raises that same UserError, or its own failure, or `PeerFailed`."""
    rows = torch.zeros(ctx.world_size, 3, dtype=torch.int64, device=ctx.device)
    if failure is not None:
        rows[ctx.rank] = torch.tensor([1, save.bytes(), _kind(failure)], dtype=torch.int64)
    else:
        rows[ctx.rank, 1] = save.bytes()
    ctx.comm.all_reduce(rows, ctx.group("world"))
    failed = [rank for rank in range(ctx.world_size) if int(rows[rank, 0]) > 0]
    if not failed:
        return
    reasons = texts(_failure_text(failure) if failure is not None else None, ctx)
    message = None
    if ctx.is_main:
        shutil.rmtree(save.partial, ignore_errors=True)
        kinds = {int(rows[rank, 2]): rank for rank in reversed(failed)}  # each kind's lowest failed rank
        if _USER in kinds:
            rank = kinds[_USER]
            message = reasons[rank] if rank == 0 else f"rank {rank}: {reasons[rank]}"
        else:
            message = _refused_save(save, int(rows[:, 1].sum()), kinds, reasons)
    agree(message, ctx)
    if failure is not None:
        raise failure
    raise PeerFailed(f"checkpoint {save.name}: rank(s) {failed} failed to write it (their logs say why)")


def _failure_text(failure: BaseException) -> str:
    if isinstance(failure, UserError):
        return str(failure)
    refused = write_refusal(failure)
    if refused is not None:
        return f"{refused.strerror}: {str(refused.filename)!r}" if refused.filename else str(refused.strerror)
    return reason(failure)


def _refused_save(save: PendingSave, tensor_bytes: int, kinds: dict[int, int], reasons: dict[int, str]) -> str | None:
    """Rank 0, the partial save removed: the one line for a save the file system refused, or None when
    nothing says it would be refused again (then the group restarts). The space a save needs is the
    newest verified checkpoint's size (the same state, saved before), else the bytes of the tensors
    the ranks write."""
    newest = choose(save.directory).path
    needed = _tree_bytes(newest) if newest is not None else tensor_bytes
    free = free_bytes(save.directory)
    if _NO_SPACE not in kinds and _REFUSED not in kinds and free >= needed:
        return None
    remains = (f"the newest verified checkpoint {newest.name} remains" if newest is not None
               else "no verified checkpoint remains (a re-run starts over)")
    mount = mount_point(save.directory)
    holding = "" if mount == Path(os.path.abspath(save.directory)) else f" (holding {str(save.directory)!r})"
    where = f"the file system mounted at {str(mount)!r}{holding}"
    if _REFUSED in kinds and _NO_SPACE not in kinds:
        return (f"cannot write checkpoint {save.name} on {where} ({reasons[kinds[_REFUSED]]}); the partial save "
                f"was removed, {remains}: make {str(save.directory)!r} writable, then re-run with --resume")
    cause = f" ({reasons[kinds[_NO_SPACE]]})" if _NO_SPACE in kinds else ""
    return (f"checkpoint {save.name} does not fit on {where}: the save needs about {size_text(needed)} and "
            f"{size_text(free)} are free{cause}; the partial save was removed, {remains}: free space there, "
            "then re-run with --resume")


def _tree_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


_MESSAGE_BYTES = 1024


def texts(text: str | None, ctx: ParallelContext) -> dict[int, str]:
    """Every rank's `text` (up to 1 KiB; None: none), by rank, on every rank (one all-reduce of world × 1 KiB)."""
    messages = torch.zeros(ctx.world_size, _MESSAGE_BYTES, dtype=torch.uint8, device=ctx.device)
    if text is not None:
        encoded = text.encode()[:_MESSAGE_BYTES] or b"?"
        messages[ctx.rank, : len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    ctx.comm.all_reduce(messages, ctx.group("world"))  # one writer per row: the sum is that row
    return {rank: bytes(messages[rank].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            for rank in range(ctx.world_size) if bool(messages[rank].any())}


def agree(error: str | None, ctx: ParallelContext) -> None:
    """Raise a UserError on every rank when any rank has `error` (the lowest such rank's, on the others)."""
    found = texts(error, ctx)
    if error is not None:
        raise UserError(error)
    if found:
        first = min(found)
        raise UserError(f"rank {first}: {found[first]}")
