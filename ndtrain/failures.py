"""Which failures of a worker recur: the rule deciding whether the elastic agent restarts the run.

A restart re-runs the same command on the same files, config and seed, so it can only help when the
failure came from outside them. `recurring_cause` applies the rule to an exception, its chain
(`__cause__`, `__context__`) and the per-rank exceptions a DCP `CheckpointException` wraps:

recurs: the run ends after the first attempt, exit status 2, one line naming the cause
    UserError                     a mistake in the input, named by the code that found it
    a corrupt input file          safetensors refusing a file (`SafetensorError`)
    a refused write or path       OSError ENOSPC, EDQUOT, EFBIG (no space), EACCES, EPERM, EROFS
                                  (no permission), ENOTDIR, EISDIR, ELOOP, ENAMETOOLONG (a path
                                  that cannot be used as given)
may not recur: the group is restarted, up to `launch.max_restarts` times
    a lost peer (`lost_peer`)     communication errors: c10d's `DistError`, gloo/NCCL transport
                                  errors, and `PeerFailed` (this rank stops because another failed);
                                  the traceback goes to the rank log only, the launcher prints the
                                  restart line
    killed and stalled ranks      a signal, or the watchdog's own exit: no exception reaches the worker
    anything else                 a bug: its traceback on the console and in the rank log

Where the source of a recurring failure knows more than the exception, it raises the UserError
itself: checkpoint/store.py for a save the file system refuses (the file system, the space needed,
the newest verified checkpoint left), checkpoint/manifest.py for a checkpoint tree with symbolic
links, checkpoint/init_from.py for a corrupt weight file, checkpoint/run_model.py for a model that
cannot be built. Imports only `errors` and library types, so every layer may use it.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Iterator

from safetensors import SafetensorError
from torch.distributed import DistError

from ndtrain.errors import UserError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
BAD_PATH = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})
# what gloo and NCCL say when a peer's end of a connection is gone
_TRANSPORT_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "NCCL communicator was aborted", "NCCL error")
_REASON_CHARS = 200


class PeerFailed(RuntimeError):
    """This rank stops because another rank failed (that rank's message names why)."""


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what caused it or was being handled (depth first), and the exception of every
    rank a `CheckpointException` carries; each exception once."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if _is_checkpoint_exception(current):
            pending += [wrapped[0] for wrapped in reversed(list(current.failures.values()))]
        pending += [e for e in (current.__context__, current.__cause__) if e is not None]


def write_refusal(error: BaseException) -> OSError | None:
    """The first OSError in `error`'s chain that a retry would meet again (no space, no permission,
    a path that is not what it must be), else None."""
    return next((e for e in chain(error) if isinstance(e, OSError) and e.errno in NO_SPACE | REFUSED | BAD_PATH), None)


def reason(error: BaseException) -> str:
    """One line saying what `error` is: its type and the first `_REASON_CHARS` characters of its message."""
    text = " ".join(str(error).split())[:_REASON_CHARS]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def recurring_cause(error: BaseException) -> str | None:
    """One line naming why `error` would happen again after a restart, or None when a restart may help."""
    for found in chain(error):
        if isinstance(found, UserError):
            return str(found)
        if isinstance(found, SafetensorError):
            return f"a weight file is not valid safetensors ({reason(found)}): replace it with an intact copy"
    refused = write_refusal(error)
    if refused is not None:
        where = f" {refused.filename!r}" if refused.filename else ""
        return f"the file system refused{where} ({refused.strerror or reason(refused)}): a restart would fail the same way"
    return None


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a communication failure (a peer died, was killed or cut off): restartable."""
    for found in chain(error):
        if isinstance(found, (DistError, PeerFailed)):
            return True
        if isinstance(found, (RuntimeError, ConnectionError)) and any(m in str(found) for m in _TRANSPORT_FAILURES):
            return True
    return False


# ---- the file system a refused write went to, for its message ------------------------------------
def mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path` (its nearest existing ancestor's)."""
    current = Path(os.path.abspath(path))
    while not current.exists():
        current = current.parent
    while not os.path.ismount(current):
        current = current.parent
    return current


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path` (0 when unknown)."""
    try:
        stats = os.statvfs(mount_point(path))
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def size_text(n_bytes: float) -> str:
    """12 KiB, 3.4 MiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 2**10:.0f} KiB"


def _is_checkpoint_exception(error: BaseException) -> bool:
    """A DCP `CheckpointException`, without importing DCP (about 1 s: DTensor, sympy) into every process:
    such an exception exists only once its module is loaded."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(error, api.CheckpointException)
