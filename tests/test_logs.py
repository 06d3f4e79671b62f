"""Logs: progress lines through a pipe, per-rank log files, warnings prefixed by rank, user errors once.

The end-to-end test runs `ndtrain train` on 2 processes with its output on pipes (no terminal),
then runs it again into the finished directory: a user error that only the workers detect.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.console import WorkerConsole, log, record_user_error, report_user_error, unprinted_user_error
from ndtrain.errors import UserError
from ndtrain.run.progress import Progress, format_eta, format_line, format_memory, resolve_mode
from ndtrain.trainer import wrap_parts
from tests.helpers.runs import corpus_file

STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss \d+\.\d{3} \| ")


# ---- the line ------------------------------------------------------------------------------
def test_progress_line_has_every_field_in_its_unit() -> None:
    line = format_line(50, 200, loss=2.2712, val=2.3649, lr=2.93e-3, grad_norm=0.8987, tokens_per_s=7403.2,
                       s_per_step=0.5512, mem_bytes=742 * 2**20, eta_s=90.4)
    assert line == ("step 50/200 | loss 2.271 | val 2.365 | lr 2.9e-03 | gnorm 0.90 | 7,403 tok/s | 0.55 s/step | "
                    "mem 742 MiB | eta 1m30s")
    assert format_line(3, 7, loss=float("nan")) == "step 3/7 | loss nan"


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (44.6, "45s"), (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"), (7500, "2h05m"),
    (86400 + 4 * 3600, "1d04h"), (float("nan"), "?"), (float("inf"), "?"), (-1, "?"),
])
def test_eta(seconds: float, text: str) -> None:
    assert format_eta(seconds) == text


def test_memory_units() -> None:
    assert format_memory(742 * 2**20) == "742 MiB"
    assert format_memory(9 * 2**30) == "9,216 MiB"
    assert format_memory(12.34 * 2**30) == "12.3 GiB"


# ---- Progress ------------------------------------------------------------------------------
class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def records() -> Records:
    handler, level = Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.mark.parametrize("mode, on_console", [("lines", True), ("bar", False), ("off", False)])
def test_one_line_every_n_steps_and_the_last(records: Records, mode: str, on_console: bool) -> None:
    """Lines at every 3rd step and at the last (resumed at step 1); the console sees them in "lines" mode only."""
    stream = io.StringIO()
    progress = Progress(mode, 3, 10, 1, True, stream)
    for step in range(2, 11):
        progress.update(step, loss=1.0, tokens=100, val=2.0 if step == 4 else None, lr=1e-3, grad_norm=1.0,
                        mem_bytes=2**20)
    progress.close()
    steps = [int(STEP_LINE.match(r.getMessage()).group(1)) for r in records.records]
    assert steps == [3, 6, 9, 10]
    assert [getattr(r, "console", True) for r in records.records] == [on_console] * 4
    assert "val" not in records.records[0].getMessage() and "val 2.000" in records.records[1].getMessage()
    assert ("step" in stream.getvalue()) == (mode == "bar")  # the bar on the given stream, lines via logging


def test_auto_is_the_bar_on_a_terminal_only() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_mode("auto", Terminal()) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "lines"
    assert resolve_mode("lines", Terminal()) == "lines"


# ---- config --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, mode", [(True, "auto"), (False, "off"), ("bar", "bar"), ("lines", "lines")])
def test_progress_setting(value: object, mode: str) -> None:
    assert load_config(None, {"log.progress": value}).log.progress == mode


def test_progress_setting_refuses_other_values() -> None:
    with pytest.raises(UserError, match=r"log.progress='fancy' is not one of auto, bar, lines, off"):
        load_config(None, {"log.progress": "fancy"})


def test_log_every_is_the_old_name_of_every() -> None:
    assert load_config(None, {"log.log_every": 7}).log.every == 7
    assert load_config(None, {"log.every": 5}).log.every == 5
    with pytest.raises(UserError, match="log.log_every is the old name of log.every: give only log.every"):
        load_config(None, {"log.log_every": 7, "log.every": 5})


# ---- console and user errors, in this process ----------------------------------------------
def test_worker_console_of_rank_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1: info to its file only; warnings and tracebacks on the console, every line prefixed. Handlers set
    before (a library Trainer's console, ensure_console) are set aside for the while and restored."""
    outer = list(log.handlers)
    with WorkerConsole(rank=1) as console:
        path = console.attach_rank_log(tmp_path)
        log.info("ndtrain: quiet")
        log.warning("ndtrain: warning: loud")
        try:
            raise RuntimeError("a bug")
        except RuntimeError as e:
            console.crash(e)
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("[rank1] ndtrain: warning: loud\n[rank1] ndtrain: error: unexpected RuntimeError")
    assert all(line.startswith("[rank1] ") for line in err.splitlines()) and "RuntimeError: a bug" in err
    assert path == tmp_path / "logs" / "rank_1.log"
    text = path.read_text()
    assert "ndtrain: quiet" in text and "ndtrain: warning: loud" in text and "RuntimeError: a bug" in text
    assert "[rank1]" not in text
    assert log.handlers == outer  # its own removed on exit, the earlier ones back


@pytest.mark.parametrize("rank", [0, 1])
def test_user_error_is_printed_by_rank_0_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with WorkerConsole() as console:
        console.attach_rank_log(tmp_path)
        report_user_error("bad value: use a good one")
    assert capsys.readouterr().err == ("ndtrain: error: bad value: use a good one\n" if rank == 0 else "")
    assert "ndtrain: error: bad value: use a good one" in (tmp_path / "logs" / f"rank_{rank}.log").read_text()
    assert json.loads(error_file.read_text())["message"] == "bad value: use a good one"  # torchrun reads this too


def test_launcher_prints_a_user_error_no_rank_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {rank: str(tmp_path / f"{rank}.json") for rank in range(4)}

    def write(rank: int, message: str, printed: bool) -> None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[rank])
        record_user_error(message, printed)

    assert unprinted_user_error(files) is None  # no files: no user error
    write(3, "only rank 3 saw this", printed=False)
    write(2, "rank 2 saw this", printed=False)
    Path(files[1]).write_text('{"message": "a torchrun error file of a crash"}')
    assert unprinted_user_error(files) == "rank 2 saw this"
    write(0, "rank 0 saw it too", printed=True)
    assert unprinted_user_error(files) is None


# ---- end to end ----------------------------------------------------------------------------
def test_two_processes_through_a_pipe(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "2", "--model", "tiny", "--steps", "6",
           "--data", corpus_file(tmp_path), "--out", str(out), "--set", "schedule.global_batch=8",
           "--set", "schedule.micro_batch=4", "--set", "data.eval_samples=8", "--set", "log.every=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m] == [2, 4, 6], proc.stdout
    assert max(len(line) for line in (proc.stdout + proc.stderr).splitlines()) <= 300
    assert "\r" not in proc.stdout + proc.stderr
    logs = {rank: (out / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)}
    for rank, text in logs.items():
        assert len(STEP_LINE.findall(text)) == 3 and f"rank {rank} (pid " in text, text
    assert "ndtrain: summary" in logs[0] and "ndtrain: summary" not in logs[1]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # the workers find the run complete
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if "error" in line]
    assert errors == [f"ndtrain: error: the run in {str(out)!r} is already complete at step 6: use a new --out "
                      f"directory, or --steps N > 6 to continue it"], again.stderr
    assert again.stdout == ""
    for rank in (0, 1):
        text = (out / "logs" / f"rank_{rank}.log").read_text()
        assert text.startswith(logs[rank]) and text.count(f"rank {rank} (pid ") == 2  # appended, not replaced
        assert "is already complete at step 6" in text[len(logs[rank]):]


def test_run_description_lines_stay_short() -> None:
    """The data description (source path, tokenizer, counts, token file) is wrapped at its "; " parts."""
    parts = ["Python standard library source in '/a/very/long/path/" + "x" * 50 + "' (734 files, 0 skipped as not UTF-8)",
             "tokenizer bytes", "train 721 documents, 11,969,650 tokens", "val 13 documents, 149,723 tokens",
             "token file RUN_DIR/data (reused)"]
    lines = wrap_parts("ndtrain: data ", parts)
    assert all(len(line) <= 160 for line in lines) and len(lines) == 2, lines
    assert lines[0].startswith("ndtrain: data Python") and lines[1].startswith("ndtrain:      tokenizer bytes; train")
    assert "; ".join(line[len("ndtrain: data "):] for line in lines) == "; ".join(parts)
    assert wrap_parts("ndtrain: data ", ["y" * 200, "z"]) == ["ndtrain: data " + "y" * 200, "ndtrain:      z"]
