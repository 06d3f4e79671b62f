"""`ndtrain train` started by mpirun or srun: every process runs the command, and none is an agent.

Each process reads its rank, the world size and its place on its host from the launcher's variables
(dist/launchers.py) and the config from the command line, and all of them first join one TCPStore
that rank 0 serves at the launcher's rendezvous address (on 127.0.0.1 only, when that is where it
is). A config every rank refuses alike is printed once, by rank 0; one that only some rank refuses (a
file its host lacks) is printed by that rank, naming it. Rank 0 then does what the local
launcher does before workers start (cli/prepare.py: every check that can refuse the run, the run
directory's marker, the token file; with `--check`, the resolved config) while the others block on
the store's key for its word: "go", or the exit status they end with: 2 after a user error (rank 0
printed the one line), 1 after a crash, 0 after `--check`. Rank 0 waits (a bounded store wait) until
every other rank has read such an ending, so none is left asking a store that is gone. After "go",
each process is one worker and builds the process group on that same store.

No elastic agent, so no restarts: a failure ends the job (mpirun ends the other ranks; srun does with
`--kill-on-bad-exit=1`) and re-running with `--resume` continues from the newest checkpoint.
`--nproc` (or `launch.nproc`) on the command line must equal the launcher's world size.

Cost: one TCP connection per rank to rank 0's store and one or two keys per rank, once.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Callable

from ndtrain.cli.prepare import prepare_run
from ndtrain.config import ParallelConfig, TrainConfig
from ndtrain.dist.launchers import LOOPBACK, Launch
from ndtrain.errors import UserError

OUTCOME = "ndtrain/launch/outcome"  # rank 0's word: GO, or the exit status every rank ends with
SEEN = "ndtrain/launch/seen/"  # + rank: that rank read an ending
GO = "go"
SEEN_WAIT_S = 30.0  # how long rank 0 waits for the others to read an ending before it exits anyway


def join_external(config: Callable[[], TrainConfig], check: bool, launch: Launch,
                  nproc_given: bool) -> tuple[int | None, Any, TrainConfig | None]:
    """(exit status, or None to train; the joined store; the config, its launch.nproc = the world size).

    `config()` reads the command line's config on every rank: what it refuses everywhere alike rank 0
    prints; a refusal of this rank's alone (a file its host lacks) is printed by this rank."""
    try:
        cfg, refused = config(), None
    except UserError as e:
        cfg, refused = None, e
    if cfg is not None and nproc_given and cfg.launch.nproc != launch.world_size:
        raise UserError(f"--nproc {cfg.launch.nproc} but {launch.launcher} started {launch.world_size} processes: "
                        f"leave --nproc out (or give --nproc {launch.world_size}); the launcher decides the processes")
    if cfg is not None:
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc=launch.world_size))
    address = launch.init_method().removeprefix("tcp://")  # raises the one-line error when no host is known
    if launch.host == LOOPBACK and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets on loopback too, as local runs
    timeout = timedelta(seconds=(cfg.parallel if cfg is not None else ParallelConfig()).timeout_s)
    if launch.rank != 0:
        store = _join(launch, address, timeout)
        status = 2 if store is None else _await_word(store, launch, timeout)
        if refused is not None and status != 2:  # rank 0 did not refuse: this rank's refusal is its own
            _say(launch, str(refused))
            status = 2
        return status, store, cfg
    store = _serve(launch, address, timeout)
    try:
        if refused is not None:
            raise refused
        assert cfg is not None
        prepare_run(cfg, check, launch.local_world_size, launch.local_rank)
    except UserError:
        _end_all(store, launch, 2)
        raise
    except BaseException:
        _end_all(store, launch, 1)
        raise
    if check:
        _end_all(store, launch, 0)
        return 0, store, cfg
    store.set(OUTCOME, GO)
    return None, store, cfg


def _serve(launch: Launch, address: str, timeout: timedelta) -> Any:
    """Rank 0's store, once every rank has connected (TCPStore's master waits for world_size clients)."""
    from torch.distributed import TCPStore

    listen_fd = None
    try:
        if launch.host == LOOPBACK:  # served on loopback only, like a local launch's stores
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                listener.bind((LOOPBACK, launch.port))
                listener.listen(128)
                listen_fd = listener.detach()
        return TCPStore(launch.host, launch.port, launch.world_size, is_master=True, timeout=timeout,
                        multi_tenant=True, master_listen_fd=listen_fd)
    except (OSError, RuntimeError) as e:  # the port taken, or a rank that never connected
        raise UserError(f"rank 0 cannot serve the rendezvous store at {address} ({launch.host_from}): "
                        f"{_first_line(e)}: give MASTER_PORT a free port, and check that every host reaches this "
                        "one there (MASTER_ADDR)") from None


def _join(launch: Launch, address: str, timeout: timedelta) -> Any:
    """A client of rank 0's store; None after printing this rank's one line when it cannot be reached."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(launch.host, launch.port, launch.world_size, is_master=False, timeout=timeout)
    except RuntimeError as e:
        _say(launch, f"cannot reach rank 0's rendezvous store at {address} ({launch.host_from}) within "
                     f"{timeout.total_seconds():g} s (parallel.timeout_s): {_first_line(e)}")
        return None


def _await_word(store: Any, launch: Launch, timeout: timedelta) -> int | None:
    """Block on rank 0's word (no polling): None to train, else the exit status to end with."""
    try:
        word = store.get(OUTCOME).decode()
    except RuntimeError as e:  # rank 0 gone (its store with it), or its preparation outlasted the timeout
        _say(launch, f"rank 0 did not finish preparing the run within {timeout.total_seconds():g} s "
                     f"(parallel.timeout_s) or ended: {_first_line(e)}")
        return 2
    if word == GO:
        return None
    store.set(f"{SEEN}{launch.rank}", "")
    return int(word)


def _end_all(store: Any, launch: Launch, status: int) -> None:
    """Rank 0: tell every rank to end with `status`, and give them a bounded while to read it."""
    store.set(OUTCOME, str(status))
    try:
        store.wait([f"{SEEN}{rank}" for rank in range(1, launch.world_size)], timedelta(seconds=SEEN_WAIT_S))
    except RuntimeError:
        pass  # a rank already gone: the launcher ends the rest


def _say(launch: Launch, message: str) -> None:
    print(f"ndtrain: error: rank {launch.rank} of {launch.launcher}'s {launch.world_size}: {message}",
          file=sys.stderr, flush=True)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
