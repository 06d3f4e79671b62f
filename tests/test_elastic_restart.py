"""Elastic restart: a worker SIGKILLed at a random moment (during a step or during a checkpoint
save) is restarted with its group, the run resumes from the newest checkpoint by itself, exits 0,
reports one restart, and its final parameters are bit-identical to an uninterrupted run.

Also: a user error is not retried, and the launcher's sockets listen on loopback only and its
workers die with it (SIGKILL of the launcher leaves no orphans).

Every run is the real command (`python -m ndtrain train --nproc 2 ...`) in a subprocess with a
hard timeout; kill moments come from a seeded RNG; waiting is polling of files and /proc.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from tests.helpers.processes import (
    RUN_ARGS, STEPS, TIMEOUT_S, References, Run, alive, assert_bit_identical, final_weights, newest_step, poll,
    restarts_reported, saving_step, train_args,
)
from tests.helpers.runs import corpus_file

# (layout, moment, rank killed): every layout, both moments, both ranks.
FULL_TRIALS = [
    ("dp2", "step", 0), ("dp2", "save", 1), ("zero1", "step", 1), ("zero1", "save", 0), ("zero3", "step", 0),
    ("zero3", "save", 1), ("pp2", "step", 1), ("pp2", "save", 0), ("dp2", "step", 1), ("zero3", "save", 0),
    ("dp2pp2", "step", 3), ("dp2pp2", "save", 0),
]
CI_TRIALS = [("dp2", "save", 0)]  # one reference run, shared with test_preemption; a kill between saves:
# slow (FULL_TRIALS), and in CI tests/test_recurring_errors.py restarts after one


# ---- fault trials ---------------------------------------------------------------------------
def kill_trial(tmp_path: Path, references: References, layout: str, moment: str, rank: int, seed: int) -> None:
    at_step = random.Random(seed).randint(2, STEPS // 2)
    run = Run(tmp_path / f"{layout}-{moment}-rank{rank}-step{at_step}", train_args(references.data, layout))
    if moment == "step":
        poll(lambda: newest_step(run.out) >= at_step, f"checkpoint {at_step}", run)
    else:
        poll(lambda: saving_step(run.out) >= at_step, f"the save of a checkpoint >= {at_step}", run)
    os.kill(run.workers()[rank], signal.SIGKILL)
    assert run.wait() == 0, run.stderr()[-3000:]
    assert restarts_reported(run) == 1
    assert "resuming at step" in run.stdout() and "after elastic restart 1" in run.stdout()
    assert_bit_identical(final_weights(run.out), references.weights(layout))


@pytest.mark.parametrize("layout,moment,rank", CI_TRIALS)
def test_killed_worker_is_restarted_and_result_is_bit_identical(
    tmp_path: Path, references: References, layout: str, moment: str, rank: int
) -> None:
    kill_trial(tmp_path, references, layout, moment, rank, seed=CI_TRIALS.index((layout, moment, rank)))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(len(FULL_TRIALS)))
def test_fault_trials_all_layouts(tmp_path: Path, references: References, trial: int) -> None:
    layout, moment, rank = FULL_TRIALS[trial]
    kill_trial(tmp_path, references, layout, moment, rank, seed=100 + trial)


def test_restart_after_the_last_checkpoint_ends_cleanly(tmp_path: Path) -> None:
    """A worker killed after the final checkpoint: the restarted group finds the run complete, exits 0."""
    args = ["--nproc", "1", "--data", corpus_file(tmp_path), *RUN_ARGS, "--steps", "3"]
    first = Run(tmp_path / "run", args)
    assert first.wait() == 0, first.stderr()[-3000:]
    restarted = Run(tmp_path / "run", args, env={**os.environ, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted.wait() == 0, restarted.stderr()[-3000:]
    assert "ndtrain: the run was complete at step 3 before elastic restart 1" in restarted.stdout()


# ---- what is not retried, sockets, orphans --------------------------------------------------
def test_user_error_in_a_worker_is_not_retried(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    run = Run(tmp_path / "run", ["--nproc", "2", "--data", str(bad), "--max-restarts", "3", *RUN_ARGS])
    assert run.wait() == 2
    errors = [line for line in run.stderr().splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and "line 2" in errors[0], run.stderr()[-2000:]  # a retry would print it again
    assert "Traceback" not in run.stderr()


def listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the TCP sockets in LISTEN state owned by `pids`."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1])
    return found


LOOPBACK_HEX = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")


def test_sockets_on_loopback_and_no_orphans_after_launcher_sigkill(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--data", corpus_file(tmp_path), *RUN_ARGS, "--steps", "100000", "--save-every", "0"]
    run = Run(tmp_path / "run", args)
    poll(lambda: (run.out / "metrics.jsonl").exists(), "training to start", run)
    workers = run.workers()
    assert sorted(workers) == [0, 1]
    sockets = listening_sockets([run.proc.pid, *workers.values()])
    assert sockets, "no listening socket found: the check would prove nothing"
    assert all(address.startswith(LOOPBACK_HEX) for address in sockets), sockets
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=TIMEOUT_S)
    poll(lambda: not any(alive(pid) for pid in workers.values()), "the workers to die with the launcher", timeout=30)


@pytest.mark.slow
def test_external_torchrun_restarts_too(tmp_path: Path, references: References) -> None:
    """Nothing in the worker depends on our launcher: torchrun's own agent restarts it just as well."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                "-m", "ndtrain")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see README: pytorch/pytorch#135712
    run = Run(tmp_path / "run", ["--data", references.data, *RUN_ARGS], launcher=torchrun, env=env)
    poll(lambda: newest_step(run.out) >= 4, "checkpoint 4", run)
    os.kill(run.workers()[1], signal.SIGKILL)
    assert run.wait() == 0, run.stderr()[-3000:]
    assert restarts_reported(run) == 1
    assert_bit_identical(final_weights(run.out), references.weights("dp2"))
