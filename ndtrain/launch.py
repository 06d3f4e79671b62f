"""Starting workers: local processes under torchrun's elastic agent, or joining an external torchrun.

`ndtrain train --nproc N` re-runs the same command line as `python -m ndtrain ...` on N local
workers under torchrun's `LocalElasticAgent`, built here rather than through `elastic_launch`
for three reasons:

- Loopback only. `TCPStore` servers listen on every interface whatever host they are given, so
  the rendezvous store is served from a socket we bind to 127.0.0.1, and so is the store the
  agent shares with the workers for their process group (a fresh one per restart), so no worker
  listens for the rendezvous either; gloo's own connections use the loopback interface (Linux `lo`).
- Restarts, and when not. A restart re-runs the same command on the same files, so it is kept for
  what may not happen again: a rank lost (killed, or its process gone), stalled (the watchdog ends
  it) or cut off (a communication error). Then the whole group is restarted up to
  `launch.max_restarts` times, with one line here naming the rank, how it ended and its log, and
  the trainer resumes from the newest checkpoint by itself; the survivors' communication errors
  go to their rank logs only. A failure that would recur ends the run after the first attempt
  (ndtrain/failures.py holds the rule): a user error, corrupt input (a safetensors file refused), a
  write the file system refuses (no space, no permission: the save's line names the file system,
  the space needed and the newest verified checkpoint), a refused checkpoint path (a symbolic link
  in the checkpoint tree), a model that cannot be built. The worker exits with status 2 after
  printing one line (rank 0) or recording it in its torchrun error file (the launcher prints the
  lowest rank's when no rank printed), naming the rank log that keeps the traceback; a status 2,
  such a record in any rank's error file (a peer may be seen failing first), or 128+SIGTERM/SIGINT
  (a clean preemption stop, see `run/preemption.py`) stops the agent's restarts.
- Output. Workers inherit the launcher's stdout and stderr (so rank 0 can draw a progress bar on a
  terminal) and each appends everything it writes to RUN_DIR/logs/rank_N.log itself (`console.py`).
  A user error is printed once: by rank 0, or here from the lowest rank's torchrun error file
  when no rank printed it; other failures name the failed ranks' log files. torchelastic's own
  lines about workers ending ("failed (exitcode ...", "Sending process ... closing signal") are
  left out: the lines above say the same, with the rank logs. The torchrun error files live in
  RUN_DIR/logs/.launch-PID while the launcher runs (`_error_folder`): a killed launcher leaves
  nothing outside its run, and the next launch removes what it left.
- Signals. SIGTERM/SIGINT to the launcher are forwarded by the agent to the workers, which finish
  the step and write a checkpoint within `STOP_GRACE_S` before the agent kills them; the launcher
  then exits with 128 + the signal number.

A process started by torchrun (ours or the user's, single or multi node) sees torchrun's
environment and runs as a worker directly; `die_with_parent` makes it end with its agent. A process
started by mpirun or srun reads its place from that launcher's variables (dist/launchers.py) and is
no one's agent: cli/external.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch

from ndtrain.console import rank_log_path, recorded_user_error, unprinted_user_error
from ndtrain.dist.launchers import detect
from ndtrain.errors import UserError
from ndtrain.run.preemption import STOP_SIGNALS, exit_status

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 120  # seconds workers get to finish a step and checkpoint after a stop signal
FINAL_EXIT_STATUSES = frozenset({2, *(exit_status(s) for s in STOP_SIGNALS)})
_PR_SET_PDEATHSIG = 1


def in_worker() -> bool:
    """True when this process was started by torchrun (ours or external)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def speaks_for_the_run() -> bool:
    """True in the one process that prints for the whole run before workers start: the launching
    process, or rank 0 of the processes mpirun or srun started (every process, when their variables
    cannot be read: each then says so)."""
    if in_worker():
        return False
    try:
        return detect(os.environ).rank == 0
    except UserError:
        return True


def set_worker_threads(threads: int) -> int:
    """Intra-op threads for this process: `threads`, or the cores shared evenly by the workers on this host."""
    if threads <= 0:
        local_workers = detect(os.environ).local_world_size
        threads = max(1, (os.cpu_count() or 1) // local_workers)
    torch.set_num_threads(threads)
    return threads


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its agent dies (no orphans after a SIGKILL).

    PR_SET_PDEATHSIG fires when the thread that forked us ends; the agent starts workers from its
    main thread. A parent dying during the call is caught by comparing parent PIDs; one that died
    while this worker was still starting up (before the call) is not.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _loopback_store() -> Any:
    """A TCPStore server listening on 127.0.0.1 only (it owns, and closes, the socket we bind)."""
    from torch.distributed import TCPStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        return TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=listener.detach())


def _final(failures: dict[int, Any]) -> bool:
    """Whether a failed attempt ends the run: a worker's exit status says so, or a worker recorded a
    user error (or a failure that would recur) before it ended, whatever its exit status."""
    return any(f.exitcode in FINAL_EXIT_STATUSES or recorded_user_error(f.error_file_data) for f in failures.values())


def _how_it_ended(failure: Any) -> str:
    return f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {failure.exitcode}"


def restart_line(failures: dict[int, Any], restart: int, max_restarts: int, run_dir: Path | None) -> str:
    """The one line of a restart: which ranks ended and how, which restart this is, and their logs.
    A rank killed by a signal explains the others' ends (their peer was lost), and the agent stops
    the rest itself with SIGTERM — escalated to SIGKILL for a survivor that does not end within its
    grace (one stuck on the lost peer) — so only the ranks that ended first (the failures' timestamps,
    whole seconds; the agent's stop of the rest comes later) are named, and those stopped by SIGTERM
    only when nothing else is."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    causes = killed or {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    first = min(f.timestamp for f in causes.values())
    causes = {r: f for r, f in causes.items() if f.timestamp == first}
    ranks = "; ".join(f"rank {r} {_how_it_ended(f)}" for r, f in sorted(causes.items()))
    where = "" if run_dir is None else "; see " + ", ".join(str(rank_log_path(run_dir, r)) for r in sorted(causes))
    return f"ndtrain: {ranks}: restarting the workers (restart {restart} of {max_restarts}), resuming from the newest checkpoint{where}"


class _WorkerEndLines(logging.Filter):
    """Leaves out torchelastic's lines about workers ending: the launcher prints its own, naming the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def _agent(argv: list[str], nproc: int, max_restarts: int, run_id: str, logs: Any, run_dir: Path | None) -> Any:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class LoopbackRendezvous(DynamicRendezvousHandler):
        """Serves the workers' store on loopback, a fresh one for each round (each restart).

        torch 2.13 keeps one workers' store for all rounds, so restarted workers read the
        previous attempt's addresses and hang or fail to connect (pytorch/pytorch#135712).
        """

        def next_rendezvous(self) -> Any:
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            return super().next_rendezvous()

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            return _loopback_store()

    class Agent(LocalElasticAgent):
        """Restarts a failed group (saying so in one line), except after a failure that would recur or a
        clean preemption stop."""

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed() and _final(result.failures):
                self._remaining_restarts = 0
            elif result.is_failed() and self._remaining_restarts > 0:
                restart = max_restarts - self._remaining_restarts + 1
                print(restart_line(result.failures, restart, max_restarts, run_dir), file=sys.stderr, flush=True)
            return result

    store = _loopback_store()
    rendezvous = LoopbackRendezvous.from_backend(
        run_id, store, C10dRendezvousBackend(store, run_id), min_nodes=1, max_nodes=1, local_addr=LOOPBACK,
    )
    spec = WorkerSpec(
        role="default", local_world_size=nproc, entrypoint=sys.executable, args=("-m", "ndtrain", *argv),
        rdzv_handler=rendezvous, max_restarts=max_restarts, monitor_interval=0.1, local_addr=LOOPBACK,
    )
    return Agent(spec, logs, start_method="spawn", shutdown_timeout=STOP_GRACE_S)


def _error_files_spec(log_dir: str) -> Any:
    """torchrun's default logs spec (no redirection: workers keep our stdout/stderr), remembering the
    per-rank error files of the newest attempt in `.error_files`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class ErrorFiles(DefaultLogsSpecs):
        def __init__(self, log_dir: str) -> None:
            super().__init__(log_dir=log_dir)
            self.error_files: dict[int, str] = {}

        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            dest = super().reify(envs)
            self.error_files = dict(dest.error_files)
            return dest

    return ErrorFiles(log_dir=log_dir)


LAUNCH_FOLDER = ".launch-"  # RUN_DIR/logs/.launch-PID: the workers' torchrun error files, while PID runs


@contextlib.contextmanager
def _error_folder(run_dir: Path | None) -> Iterator[str]:
    """The folder of the workers' torchrun error files, removed at the end. A run's lies in its own run
    directory (RUN_DIR/logs/.launch-PID), so a launcher killed before removing it leaves nothing
    outside the run; the next launch removes the folders of launchers no longer alive. Without a run
    directory (`ndtrain bench`), a temporary folder."""
    if run_dir is None:
        with tempfile.TemporaryDirectory(prefix="ndtrain-launch-") as folder:
            yield folder
        return
    logs = run_dir / "logs"
    for stale in logs.glob(LAUNCH_FOLDER + "*"):
        pid = stale.name[len(LAUNCH_FOLDER):]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = logs / f"{LAUNCH_FOLDER}{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def launch_local(argv: list[str], nproc: int, max_restarts: int = 0, run_dir: Path | None = None) -> int:
    """Run `python -m ndtrain *argv` on `nproc` local workers; return the exit status to report.

    0: the workers finished (after at most `max_restarts` restarts). 2: a worker's user error
    (printed once, see `console.py`). 128+N: stopped by signal N, a checkpoint written (rank 0 printed the line).
    1: workers kept failing; the failed ranks are named.
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker then sets its own thread count
    if os.path.exists("/sys/class/net/lo"):  # gloo's pair sockets on loopback, not the hostname's address
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run_id = f"ndtrain-{uuid.uuid4().hex[:8]}"
    with _error_folder(run_dir) as log_dir:
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(log_dir, "error.json"))
        logs = _error_files_spec(log_dir)
        agent = _agent(argv, nproc, max_restarts, run_id, logs, run_dir)
        worker_ends = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        quiet = _WorkerEndLines()
        worker_ends.addFilter(quiet)
        try:
            result = agent.run()
        except SignalException as e:  # the agent has forwarded it and waited for the workers
            return exit_status(e.sigval)
        finally:
            worker_ends.removeFilter(quiet)
        agent.get_worker_group().spec.rdzv_handler.shutdown()
        if not result.is_failed():
            return 0
        message = unprinted_user_error(logs.error_files)
    if message is not None:
        print(f"ndtrain: error: {message}", file=sys.stderr, flush=True)
    codes = {rank: failure.exitcode for rank, failure in result.failures.items()}
    final = sorted({code for code in codes.values() if code in FINAL_EXIT_STATUSES})
    if final:
        return final[0]
    if _final(result.failures):  # a recorded user error, its rank seen ending by the agent's signal
        return 2
    details = ", ".join(f"rank {r} exit code {c}" for r, c in sorted(codes.items()))
    where = "the worker output above"
    if run_dir is not None:
        where = ", ".join(str(rank_log_path(run_dir, r)) for r in sorted(codes))
    print(f"ndtrain: error: worker failure ({details}) after {max_restarts} restart(s); see {where}", file=sys.stderr)
    return 1
