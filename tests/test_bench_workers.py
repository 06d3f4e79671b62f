"""Benchmark workers end when their launcher dies, as training workers do (launch.die_with_parent):
the launcher's whole process group is SIGKILLed once both workers joined the rendezvous (so past
their start-up, where the kernel's parent-death signal is armed) and no worker may outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.processes import TIMEOUT_S, alive, children, poll, read_environ


def bench_workers(launcher: int) -> dict[int, int]:
    """Global rank → PID of the launcher's live benchmark workers."""
    found = {}
    for pid in children(launcher):
        env = read_environ(pid)
        if "RANK" in env and alive(pid):
            found[int(env["RANK"])] = pid
    return found


def connected(pid: int) -> bool:
    """`pid` holds an established TCP connection (a worker past start-up: it joined the rendezvous store)."""
    try:
        inodes = {link.split("[")[1][:-1] for link in (str(fd.readlink()) for fd in Path(f"/proc/{pid}/fd").iterdir())
                  if link.startswith("socket:[")}
        tables = [Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:] for name in ("tcp", "tcp6")]
    except OSError:
        return False
    return any(fields[3] == "01" and fields[9] in inodes for table in tables for fields in map(str.split, table))


def test_bench_workers_die_with_their_launcher(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with open(tmp_path / "stderr", "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "ndtrain", "bench", "ddp", "--nproc", "2", "--model", "tiny", "--steps", "100000",
             "--repeats", "1", "--out", str(out)],
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        workers = poll(lambda: (found := bench_workers(launcher.pid)) and len(found) == 2
                       and all(map(connected, found.values())) and found,
                       "both benchmark workers to join the rendezvous", timeout=TIMEOUT_S)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's process group: the workers run in sessions of their own
        launcher.wait(timeout=TIMEOUT_S)
        poll(lambda: not any(alive(pid) for pid in workers.values()), "the workers to die with the launcher", timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
