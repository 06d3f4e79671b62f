"""This host's processes as /proc shows them: which PIDs name the same processes, a process's
state and start, and the worker of a given rank that this worker's agent started.

Read by the watchdog (dist/watchdog.py) to say what became of a peer on this host and to SIGKILL
it when stopped. Linux only: elsewhere every function answers None. Cost: a few small file reads,
only while a stall is being diagnosed.
"""

from __future__ import annotations

import os
from typing import Any


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def host_identity() -> str | None:
    """Same value ⇔ PIDs name the same processes (boot, PID and network namespace); None off Linux."""
    try:
        boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
        pid_ns, net_ns = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "net"))
    except OSError:
        return None
    return f"{boot}:{pid_ns}:{net_ns}" if boot else None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, from /proc/PID/stat."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _environ(pid: int) -> dict[str, str]:
    text = _read(f"/proc/{pid}/environ")
    return dict(item.split("=", 1) for item in (text or "").split("\0") if "=" in item)


def local_worker(rank: int) -> dict[str, Any] | None:
    """The process of global rank `rank` that this worker's agent started on this host (same parent,
    same TORCHELASTIC_RUN_ID), as a heartbeat-like record (pid, start); None if there is none."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    parent = os.getppid()
    if run_id is None or parent <= 1:
        return None
    children: list[str] = []
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return None
    for task in tasks:
        children += (_read(f"/proc/{parent}/task/{task}/children") or "").split()
    for pid in map(int, children):
        env = _environ(pid)
        stat = proc_stat(pid)
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("RANK") == str(rank) and stat is not None:
            return {"pid": pid, "start": stat[1], "host": host_identity()}
    return None
