"""Preemption and the run lock, end to end through the real command.

SIGTERM to the launcher (or SIGINT to one worker) stops every rank after the same step with a
checkpoint of that step, one line and exit status 128 + signal; re-running the same command
continues to parameters bit-identical to an uninterrupted run. A second run into a directory
whose lock is held is refused with one line naming the holder and writes nothing.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import signal
from pathlib import Path

from tests.helpers.processes import (
    RUN_ARGS, References, Run, assert_bit_identical, final_weights, newest_step, poll, train_args,
)
from tests.helpers.runs import corpus_file

# Checkpoints only when stopped (and at the end), so the one written is the signal's doing.
STOP_ARGS = ["--save-every", "0", "--set", "log.log_every=1"]


def steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def stopped_line(run: Run, signame: str) -> int:
    """The step named by the run's one 'stopped by' line (asserting there is exactly one)."""
    lines = [line for line in run.stderr().splitlines() if line.startswith("ndtrain: stopped by")]
    assert len(lines) == 1, run.stderr()[-3000:]
    match = re.fullmatch(
        rf"ndtrain: stopped by {signame} at step (\d+); checkpoint step_(\d+) written; "
        r"re-run the same command to continue", lines[0])
    assert match and int(match.group(1)) == int(match.group(2)), lines[0]
    return int(match.group(1))


def test_sigterm_to_launcher_checkpoints_and_rerun_is_bit_identical(tmp_path: Path, references: References) -> None:
    args = [*train_args(references.data, "dp2"), *STOP_ARGS]
    at_step = random.Random(13).randint(2, 8)
    run = Run(tmp_path / "run", args)
    poll(lambda: steps_logged(run.out) >= at_step, f"step {at_step}", run)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    step = stopped_line(run, "SIGTERM")
    assert at_step <= step < 20
    assert newest_step(run.out) == step and (run.out / "checkpoints" / f"step_{step:08d}").is_dir()
    assert "Traceback" not in run.stderr()

    again = Run(run.out, args)
    assert again.wait() == 0, again.stderr()[-3000:]
    assert f"resuming at step {step}" in again.stdout()
    assert_bit_identical(final_weights(run.out), references.weights("dp2"))


def test_sigint_to_one_worker_stops_every_rank_at_one_step(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", [*train_args(corpus_file(tmp_path), "zero1"), *STOP_ARGS])
    poll(lambda: steps_logged(run.out) >= 3, "step 3", run)
    os.kill(run.workers()[1], signal.SIGINT)
    assert run.wait() == 128 + signal.SIGINT, run.stderr()[-3000:]
    step = stopped_line(run, "SIGINT")
    assert newest_step(run.out) == step  # a collective save: both ranks were at this step
    assert run.stdout().count("ndtrain: starting") == 1  # a clean stop is not restarted
    assert "Traceback" not in run.stderr()


def test_second_run_into_a_locked_directory_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as lock:  # this test process plays the live run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        run = Run(out, [*RUN_ARGS, "--nproc", "2", "--data", corpus_file(tmp_path)])
        assert run.wait() == 2
    errors = [line for line in run.stderr().splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and f"in use by process {os.getpid()}" in errors[0], run.stderr()[-2000:]
    assert "Traceback" not in run.stderr()
    assert [p.name for p in out.iterdir()] == [".lock"]
