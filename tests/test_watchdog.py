"""Hang diagnosis: a stalled rank ends every live rank with one line naming who did not arrive.

Unit tests run gloo workers (tests/helpers/runner.py) where one rank stops itself (a real SIGSTOP)
or waits in another collective; end-to-end tests SIGSTOP one worker of `ndtrain train --nproc N`
mid-training and bound the whole run by watchdog + 15 s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from ndtrain.dist.comm import Group
from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.dist.watchdog import Phase, Watchdog
from tests.helpers.processes import no_restarts, wait_for
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file

WATCHDOG_S = 10


def _one_rank_stops(watchdog_s: float) -> None:
    ctx = init(ParallelConfig(watchdog_s=watchdog_s, timeout_s=120), init_method=init_method())
    t = torch.ones(8)
    ctx.comm.all_reduce(t, ctx.group("dp"))  # collective #1 on 'dp': everyone arrives
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # stalls before #2
    ctx.comm.all_reduce(t, ctx.group("dp"))


def test_rank_that_stops_is_named_by_every_live_rank(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="exited with status 1"):
        run_distributed(_one_rank_stops, 3, 2.0, timeout=60)
    errors = sorted(line for line in capfd.readouterr().err.splitlines() if line.startswith("ndtrain: error:"))
    assert len(errors) == 2, errors
    for rank, line in zip((0, 1), errors):
        assert re.fullmatch(
            rf"ndtrain: error: rank {rank} waited \d+ s in collective #2 all_reduce on axis 'dp' \(ranks \[0, 1, 2\]\); "
            r"ranks \[2\] did not arrive \(rank 2: last seen \d+ s ago at #[01] on axis 'dp', "
            r"its process (is stopped \(SIGSTOP\), so killed|has exited)\)",
            line,
        ), line
    assert any("is stopped (SIGSTOP), so killed" in line for line in errors)


def _crossed_collectives(watchdog_s: float) -> None:
    """Ranks 0 and 1 wait in a collective of all three ranks, rank 2 in one of ranks {1, 2}: a deadlock."""
    ctx = init(ParallelConfig(watchdog_s=watchdog_s, timeout_s=120), init_method=init_method())
    pair_pg = dist.new_group([1, 2])
    t = torch.ones(8)
    if ctx.rank == 2:
        ctx.comm.all_reduce(t, Group("pair", (1, 2), 1, pair_pg))
    else:
        ctx.comm.all_reduce(t, ctx.group("dp"))


def test_ranks_waiting_elsewhere_are_behind_not_missing(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="exited with status 1"):
        run_distributed(_crossed_collectives, 3, 2.0, timeout=60)
    errors = sorted(line for line in capfd.readouterr().err.splitlines() if line.startswith("ndtrain: error:"))
    assert [re.sub(r"waited \d+ s", "waited N s", line) for line in errors] == [
        "ndtrain: error: rank 0 waited N s in collective #1 all_reduce on axis 'dp' (ranks [0, 1, 2]); "
        "ranks [2] are alive but behind (rank 2 waits in #1 all_reduce on axis 'pair')",
        "ndtrain: error: rank 1 waited N s in collective #1 all_reduce on axis 'dp' (ranks [0, 1, 2]); "
        "ranks [2] are alive but behind (rank 2 waits in #1 all_reduce on axis 'pair')",
        "ndtrain: error: rank 2 waited N s in collective #1 all_reduce on axis 'pair' (ranks [1, 2]); "
        "ranks [1] are alive but behind (rank 1 waits in #1 all_reduce on axis 'dp')",
    ]


def _different_collectives(watchdog_s: float) -> None:
    """Rank 0 all-reduces while rank 1 all-gathers, both as collective #1 on 'dp': a program error that gloo
    leaves hanging (seen when ZeRO-3 ranks ran different numbers of evaluation forwards)."""
    ctx = init(ParallelConfig(watchdog_s=watchdog_s, timeout_s=120), init_method=init_method())
    if ctx.rank == 0:
        ctx.comm.all_reduce(torch.ones(2, dtype=torch.float64), ctx.group("dp"))
    else:
        ctx.comm.all_gather(torch.empty(8), torch.ones(4), ctx.group("dp"))


def test_ranks_in_different_collectives_are_named_as_a_program_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="exited with status 1"):
        run_distributed(_different_collectives, 2, 2.0, timeout=60)
    errors = sorted(line for line in capfd.readouterr().err.splitlines() if line.startswith("ndtrain: error:"))
    assert [re.sub(r"waited \d+ s", "waited N s", line) for line in errors] == [
        "ndtrain: error: rank 0 waited N s in collective #1 all_reduce on axis 'dp' (ranks [0, 1]); ranks [1] issued "
        "another collective as #1 on this axis (rank 1 waits in #1 all_gather): the ranks issued different "
        "collectives, a program error (e.g. a rank running fewer forwards), not a stall",
        "ndtrain: error: rank 1 waited N s in collective #1 all_gather on axis 'dp' (ranks [0, 1]); ranks [0] issued "
        "another collective as #1 on this axis (rank 0 waits in #1 all_reduce): the ranks issued different "
        "collectives, a program error (e.g. a rank running fewer forwards), not a stall",
    ]


def _reduce_scatter_stall(watchdog_s: float) -> None:
    """gloo's reduce-scatter ignores `work.wait(timeout)`: the watchdog must not rely on it."""
    ctx = init(ParallelConfig(watchdog_s=watchdog_s, timeout_s=120), init_method=init_method())
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    ctx.comm.reduce_scatter(torch.empty(4), torch.ones(8), ctx.group("dp"))


def test_reduce_scatter_stall_is_caught(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="rank 0 exited with status 1"):
        run_distributed(_reduce_scatter_stall, 2, 2.0, timeout=60)
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and "collective #1 reduce_scatter on axis 'dp'" in errors[0], errors
    assert "ranks [1] did not arrive" in errors[0]


class _HeldStore:
    """A store whose `set` calls that `held(key)` picks are held until `release` (a store slow to answer)."""

    def __init__(self, held: Callable[[str], bool]) -> None:
        self.held = held
        self.entered, self.release = threading.Event(), threading.Event()

    def clone(self) -> "_HeldStore":
        return self

    def set_timeout(self, timeout: object) -> None:
        pass

    def set(self, key: str, value: str) -> None:
        if self.held(key):
            self.entered.set()
            self.release.wait()


HELD_CALLS = {
    "heartbeat": lambda key: threading.current_thread().name == "ndtrain-watchdog-beat",
    "phase publish": lambda key: "/phase/" in key,
}


@pytest.mark.parametrize("held", HELD_CALLS)
def test_stop_waits_for_the_store_calls_of_its_threads(held: str) -> None:
    """A watchdog thread still inside a store call when its process exits aborted that process after its
    work was done (a daemon thread returning into a finalizing interpreter from C++: "terminate called
    without an active exception", exit -6; seen twice in 195 two-rank runs under load). stop() now waits
    for the heartbeat's call and for a phase publish's, including one started on another thread just
    before stop() (listed under a lock as it starts: without it, 32 of 60 runs under load missed it)."""
    before = set(threading.enumerate())
    store = _HeldStore(HELD_CALLS[held])
    watchdog = Watchdog(0, store, 0.4, {}, tick_s=0.05, grace_s=60).start()  # a heartbeat every 0.1 s
    phase = Phase("evaluation", "a test phase", 600.0, "a test", time.monotonic())

    def enter_and_leave() -> None:
        with watchdog.phase(phase):  # publishes the phase on entry (the held case) and on exit
            pass

    in_phase = threading.Thread(target=enter_and_leave)
    in_phase.start()
    assert store.entered.wait(60)
    stopper = threading.Thread(target=watchdog.stop)
    stopper.start()
    stopper.join(1.0)
    assert stopper.is_alive()  # still waiting for the held call (up to 2 * grace_s)
    store.release.set()
    for thread in (stopper, in_phase):
        thread.join(60)
    assert set(threading.enumerate()) - before == set()  # every thread of the test and the watchdog ended


@pytest.mark.parametrize("value", [0.0, -1.0, 121.0, float("nan")])
def test_watchdog_setting_is_checked(value: float) -> None:
    with pytest.raises(UserError, match=r"parallel.watchdog_s must be in \(0, 120\]"):
        ParallelConfig(watchdog_s=value).validate()


# ---- end to end: SIGSTOP one worker of `ndtrain train --nproc N` -------------------------------

def _worker_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item[5:]) for item in env if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def find_worker(launcher_pid: int, rank: int) -> int:
    """PID of the worker with global rank `rank` among the launcher's children (from /proc)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    found = [int(pid) for pid in children if _worker_rank(int(pid)) == rank]
    assert len(found) == 1, f"rank {rank} not among the launcher's children {children}"
    return found[0]


# 4 processes run as `slow` (make test-slow): the same rule as 2, 22 s of CI time
@pytest.mark.serial  # the end is bounded in wall-clock seconds: `make test` runs it alone
@pytest.mark.parametrize("nproc, victim", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_sigstopped_worker_ends_the_run_within_watchdog_plus_15_s(tmp_path: Path, nproc: int, victim: int) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "ndtrain", "train", "--nproc", str(nproc), "--model", "tiny", "--steps", "100000",
        "--data", corpus_file(tmp_path), "--out", str(out), "--set", "schedule.global_batch=8",
        "--set", "schedule.micro_batch=2", "--set", "log.progress=false", "--set", "log.log_every=1",
        "--set", f"parallel.watchdog_s={WATCHDOG_S}", *no_restarts(),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(out / "metrics.jsonl", proc, timeout=120)
        worker = find_worker(proc.pid, victim)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=WATCHDOG_S + 15)
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr[-3000:]
    assert elapsed <= WATCHDOG_S + 15
    prefixed = [re.fullmatch(r"(?:\[rank(\d+)\] )?(ndtrain: error: rank (\d+) .*)", line) for line in stderr.splitlines()]
    assert all(m.group(1) == (m.group(3) if m.group(3) != "0" else None) for m in prefixed if m)  # [rankN] but rank 0
    errors = [m.group(2) for m in prefixed if m]
    live = sorted(set(range(nproc)) - {victim})
    assert sorted(int(line.split()[3]) for line in errors) == live, stderr[-3000:]
    group = ", ".join(str(r) for r in range(nproc))
    for line in errors:
        assert re.search(
            rf"waited \d+ s in collective #\d+ \w+ on axis '\w+' \(ranks \[{group}\]\); ranks \[{victim}\] did not "
            rf"arrive \(rank {victim}: last seen \d+ s ago at #\d+ on axis '\w+', its process", line
        ), line
    assert any("is stopped (SIGSTOP), so killed" in line for line in errors), errors
    stat = Path(f"/proc/{worker}/stat")  # the stopped worker is gone (at most a zombie), not orphaned
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
