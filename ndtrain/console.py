"""What a worker prints where: the console, its rank log file, and user errors printed once.

A worker of `ndtrain train` (a torchrun worker, or the launcher itself with `--nproc 1`) enters
`WorkerConsole`, which configures the "ndtrain" logger:

- Console: rank 0's info lines (run description, progress lines, summary) on stdout; warnings and
  errors of every rank on stderr. Lines of ranks other than 0 are prefixed `[rankN] `. Python
  warnings go the same way (`logging.captureWarnings`).
- `RUN_DIR/logs/rank_N.log`, attached once the run directory is locked (`attach_rank_log`): the
  process's file descriptors 1 and 2 are pointed at it (opened for appending, so an elastic
  restart adds to it and nothing the process, its libraries or the C++ runtime writes is lost even
  if it crashes), and every "ndtrain" record goes there with a timestamp, progress lines included
  whatever `log.progress` shows on the console. The console keeps the original descriptors.
- A user error is printed once on the console, whichever ranks raised it: rank 0 prints its own;
  every rank writes its message to torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE) with
  whether it was printed, and the launcher prints the lowest rank's message when no rank did
  (`unprinted_user_error`), e.g. an error that only rank 1 detected.
- A failure that would recur (ndtrain/failures.py: corrupt input, a write the file system refuses)
  is reported like a user error, naming the rank log, which keeps its traceback (`log_only`); a
  communication error after a peer's death goes to the rank log only: the launcher prints the
  restart line. Both exit like their kind: 2 (the run ends), 1 (the group restarts).
- A bug (any other exception) is logged with its traceback on the console and the rank log;
  the worker exits with status 1, which torchrun's agent restarts.

Used as a library (a `Trainer` in one's own script), `ensure_console` gives the "ndtrain" logger a
plain console handler (what the trainer printed before it logged) unless the application gave
that logger handlers of its own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from ndtrain.dist.launchers import detect

log = logging.getLogger("ndtrain")
FILE_ONLY = {"console": False}  # `extra=` of a record the console handler skips: it goes to the rank log only
LOGS_DIR = "logs"
_ERROR_KEY = "ndtrain_user_error"


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.log"


class ConsoleHandler(logging.Handler):
    """Info records to `out`, warnings and errors to `err` (None: sys.stdout/sys.stderr when written),
    each line prefixed with `prefix`; records logged with `extra={"console": False}` are skipped."""

    def __init__(self, level: int, prefix: str = "", out: TextIO | None = None, err: TextIO | None = None) -> None:
        super().__init__(level)
        self.prefix, self.out, self.err = prefix, out, err

    @property
    def stderr(self) -> TextIO:
        return self.err if self.err is not None else sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", True):
            return
        try:
            text = self.format(record)
            if self.prefix:
                text = "\n".join(self.prefix + line for line in text.splitlines())
            stream = self.stderr if record.levelno >= logging.WARNING else (self.out or sys.stdout)
            stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def console_stream() -> TextIO:
    """The console's stderr as the "ndtrain" logger's console handler knows it (for a progress bar)."""
    for handler in log.handlers:
        if isinstance(handler, ConsoleHandler):
            return handler.stderr
    return sys.stderr


def ensure_console(main: bool) -> None:
    """Library use: a console handler (info on the main rank, warnings everywhere) unless the
    "ndtrain" logger already has handlers (records still propagate to the application's loggers)."""
    if log.handlers:
        return
    log.addHandler(ConsoleHandler(logging.INFO if main else logging.WARNING))
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _worker_rank() -> int:
    """This process's global rank as its launcher set it: torchrun, mpirun or srun (0 without one)."""
    return detect(os.environ).rank


def record_user_error(message: str, printed: bool) -> None:
    """Write the message into torchrun's error file for this worker (no-op outside torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": message, "timestamp": int(time.time()), _ERROR_KEY: {"message": message, "printed": printed}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the launcher then reports the failure by exit status and names the rank logs


def report_user_error(message: str) -> None:
    """A user error in a worker: on the console once (rank 0 here, otherwise by the launcher), in the
    rank log, in torchrun's error file."""
    text = f"ndtrain: error: {message}"
    main = _worker_rank() == 0
    if main:  # straight to the console, unprefixed whatever the layout
        consoles = [h for h in log.handlers if isinstance(h, ConsoleHandler)]
        stream = consoles[0].stderr if consoles else sys.stderr
        stream.write(text + "\n")
        stream.flush()
    log.error(text, extra=FILE_ONLY)
    record_user_error(message, printed=main)


def recorded_user_error(error_file_data: Any) -> bool:
    """Whether a worker's torchrun error file (as read by torchrun) holds a user error it recorded."""
    return isinstance(error_file_data, dict) and isinstance(error_file_data.get(_ERROR_KEY), dict)


def unprinted_user_error(error_files: dict[int, str]) -> str | None:
    """The launcher's side of `report_user_error`: the lowest rank's user error message when no rank
    printed one (None when one was printed or no rank reported one)."""
    found: dict[int, dict[str, Any]] = {}
    for rank, path in error_files.items():
        try:
            entry = json.loads(Path(path).read_text()).get(_ERROR_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("message"), str):
            found[rank] = entry
    if not found or any(entry.get("printed") for entry in found.values()):
        return None
    return found[min(found)]["message"]


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()


class WorkerConsole:
    """Entered for the life of a training worker (see the module docstring); restores everything on exit."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = _worker_rank() if rank is None else rank
        self._saved_fds: list[int] = []
        self._handlers: list[logging.Handler] = []
        self._level = log.level
        self._propagate = log.propagate
        self._outer: list[logging.Handler] = []  # handlers set before (e.g. by ensure_console), set aside
        self.log_path: Path | None = None  # RUN_DIR/logs/rank_N.log once attached

    def __enter__(self) -> WorkerConsole:
        sys.stdout.flush()
        sys.stderr.flush()
        self._outer = list(log.handlers)
        for handler in self._outer:
            log.removeHandler(handler)
        main = self.rank == 0
        out, err = self._console_streams()
        console = ConsoleHandler(logging.INFO if main else logging.WARNING, "" if main else f"[rank{self.rank}] ",
                                 out, err)
        self._add(console)
        log.setLevel(logging.INFO)
        log.propagate = False
        logging.captureWarnings(True)
        logging.getLogger("py.warnings").addHandler(console)
        return self

    def _console_streams(self) -> tuple[TextIO | None, TextIO | None]:
        """Line-buffered copies of descriptors 1 and 2, so the console survives `attach_rank_log`;
        (None, None) when sys.stdout/sys.stderr are not real files (then nothing is redirected)."""
        try:
            fds = [sys.stdout.fileno(), sys.stderr.fileno()]
        except (AttributeError, OSError, ValueError):
            return None, None
        if fds != [1, 2]:
            return None, None
        self._saved_fds = [os.dup(1), os.dup(2)]
        return (os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace"),
                os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace"))

    def _add(self, handler: logging.Handler) -> None:
        log.addHandler(handler)
        self._handlers.append(handler)

    def attach_rank_log(self, run_dir: Path) -> Path:
        """Append this process's output and the "ndtrain" records to RUN_DIR/logs/rank_N.log from now on."""
        path = rank_log_path(run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = path
        file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed in __exit__)
        handler = logging.StreamHandler(file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        self._add(handler)
        logging.getLogger("py.warnings").addHandler(handler)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log.info(f"ndtrain: rank {self.rank} (pid {os.getpid()}, elastic restart {restart}) logging to {path}",
                 extra=FILE_ONLY)
        if self._saved_fds:
            sys.stdout.flush()
            sys.stderr.flush()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        return path

    def crash(self, error: BaseException) -> None:
        """A bug: its traceback on the console (rank-prefixed) and in the rank log."""
        log.error(f"ndtrain: error: unexpected {type(error).__name__} on rank {self.rank}:\n{_traceback(error)}")

    def log_only(self, error: BaseException, what: str) -> None:
        """A failure whose one line is printed elsewhere (by rank 0 or the launcher): its traceback in
        the rank log only, after `what` happened."""
        log.error(f"ndtrain: {what} on rank {self.rank}:\n{_traceback(error)}", extra=FILE_ONLY)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        warnings_log = logging.getLogger("py.warnings")
        for handler in self._handlers:
            log.removeHandler(handler)
            warnings_log.removeHandler(handler)
            handler.close()
            if isinstance(handler, logging.StreamHandler):
                handler.stream.close()
            if isinstance(handler, ConsoleHandler):
                for stream in (handler.out, handler.err):
                    if stream is not None:
                        stream.close()
        logging.captureWarnings(False)
        log.setLevel(self._level)
        log.propagate = self._propagate
        for handler in self._outer:
            log.addHandler(handler)
        self._outer = []
        for target, fd in zip((1, 2), self._saved_fds):
            os.dup2(fd, target)
            os.close(fd)
        self._saved_fds = []
