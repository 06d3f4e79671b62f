"""Hang diagnosis: a wait longer than `parallel.watchdog_s` becomes one message, then the process ends.

Every wait on a collective or point-to-point operation arms the watchdog with a `Wait` (operation,
axis, sequence number, the group's ranks and the peers expected to arrive) and disarms it when
the wait returns. A monitor thread, which never touches the network, checks the armed wait every
`tick_s` (0.5 s); a second thread publishes heartbeats and, while this rank waits, watches for
the alarm. Past the deadline the rank raises the alarm in the c10d store and publishes its wait;
every other rank that has been waiting for more than a tick sees the alarm and publishes its own. After a grace
of `grace_s` (3 s) each rank reads what its peers published and classifies them:

    arrived        published a wait and had issued this axis' collective #seq (or later)
    behind         alive and waiting, but in another (earlier) operation: named with that wait
    did not arrive published nothing: named with its heartbeat (the axis sequence numbers it had
                   issued and how long ago), and, on this host, its process state

It prints `ndtrain: error: rank R waited N s in collective #S OP on axis 'A' (ranks [...]);
ranks [...] did not arrive (...)` once, SIGKILLs peers on this host that are stopped (a stopped
process ignores the agent's SIGTERM until the agent's 30 s grace ends), waits (at most `grace_s`)
until the other ranks that joined the diagnosis have printed theirs, and exits with status 1
through `os._exit`: the main thread is blocked inside the communication library and
`destroy_process_group` could wait on the dead peer. gloo's `work.wait(timeout)` alone would not
do: reduce-scatter ignores the timeout and waits the process group's own (init) timeout.

Cost: nothing on the hot path but two attribute stores per wait. The second thread does one
store `set` per heartbeat (every min(5 s, watchdog_s / 4)) and, only while a wait exceeds a
tick, one store `check` per tick. A TCP store client whose link is cut blocks far beyond its
timeout, so the store is used through clients of its own and the diagnosis and the exit run
with time limits (2 · grace_s, grace_s + 1 s): an unreachable store delays the message by
seconds and shortens it to "the rendezvous store does not answer", never suppresses it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

_PREFIX = "ndtrain/watchdog"


@dataclass(frozen=True)
class Wait:
    """What one rank is waiting for: `seq` is the axis' sequence number of (the first of) the op(s)."""

    op: str
    axis: str
    seq: int
    ranks: tuple[int, ...]
    peers: tuple[int, ...]
    collective: bool

    def describe(self) -> str:
        kind = "collective" if self.collective else "operation"
        return f"{kind} #{self.seq} {self.op} on axis {self.axis!r} (ranks {list(self.ranks)})"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _bounded(fn: Callable[[], None], seconds: float) -> None:
    """Run `fn` on a daemon thread for at most `seconds` (a store call may block past its timeout);
    its errors count as not having finished."""

    def guarded() -> None:
        try:
            fn()
        except RuntimeError:
            pass

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    thread.join(seconds)


def host_identity() -> str | None:
    """Same value ⇔ PIDs name the same processes (boot, PID and network namespace); None off Linux."""
    try:
        boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
        pid_ns, net_ns = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "net"))
    except OSError:
        return None
    return f"{boot}:{pid_ns}:{net_ns}" if boot else None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, from /proc/PID/stat."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


class Watchdog:
    """Turns a wait longer than `timeout_s` on this rank into a diagnosis on every live rank."""

    def __init__(
        self, rank: int, store: Any, timeout_s: float, issued: Mapping[str, int], *,
        tick_s: float = 0.5, grace_s: float = 3.0,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._issued = issued  # the communicator's per-axis sequence numbers (read, never written)
        self._store, self._beat_store = store.clone(), store.clone()  # the beat's may block for good
        for client in (self._store, self._beat_store):
            client.set_timeout(timedelta(seconds=grace_s))
        self._tick_s = tick_s
        self._grace_s = grace_s
        self._beat_s = min(5.0, timeout_s / 4)
        self._armed: tuple[Wait, float] | None = None
        self._stalled = threading.Event()
        self._alarm = threading.Event()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._monitor, name="ndtrain-watchdog", daemon=True),
            threading.Thread(target=self._beat, name="ndtrain-watchdog-beat", daemon=True),
        ]
        stat = _proc_stat(os.getpid())
        self._identity = {"pid": os.getpid(), "host": host_identity(), "start": stat[1] if stat else None}

    def start(self) -> "Watchdog":
        """Publish the first heartbeat (so a rank that stalls at once is still known), then watch."""
        self._publish(self._beat_store, "beat", {})
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._threads[0].join()  # the beat thread may be blocked on an unreachable store: not joined

    def arm(self, wait: Wait) -> None:
        self._armed = (wait, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    def hold_if_stalled(self) -> None:
        """Called by a wait that failed: while a diagnosis is under way, the failure is its
        consequence (a peer exited first), so block until the watchdog ends the process."""
        if self._stalled.is_set():
            threading.Event().wait()

    def _monitor(self) -> None:
        while not self._stop.wait(self._tick_s):
            armed = self._armed
            if armed is not None:
                waited = time.monotonic() - armed[1]
                if waited >= self.timeout_s or (waited >= self._tick_s and self._alarm.is_set()):
                    self._stall(armed[0], waited)

    def _beat(self) -> None:
        next_beat = time.monotonic() + self._beat_s
        while not self._stop.wait(self._tick_s):
            armed, now = self._armed, time.monotonic()
            if armed is not None and now - armed[1] >= self._tick_s and self._alarm_raised():
                self._alarm.set()
            if now >= next_beat:
                self._publish(self._beat_store, "beat", {})
                next_beat = now + self._beat_s

    def _stall(self, wait: Wait, waited: float) -> None:
        """Print the diagnosis as the command line's one error line; end the process once the
        other ranks that joined the diagnosis have printed theirs (at most `grace_s` later), so
        that the agent, which stops every worker when the first one exits, cuts no message off."""
        self._stalled.set()
        result: list[tuple[str, list[dict[str, Any]]]] = []
        _bounded(lambda: result.append(self.diagnose(wait, waited)), 2 * self._grace_s)
        message, stopped = result[0] if result else (self._unanswered(wait, waited), [])
        sys.stdout.flush()
        logging.getLogger("ndtrain").error(f"ndtrain: error: {message}")
        _bounded(self._await_reports, self._grace_s + 1)
        for beat in stopped:
            self._kill_if_stopped(beat)
        os._exit(1)

    def _await_reports(self) -> None:
        reported = self._store.add(f"{_PREFIX}/reported", 1)
        deadline = time.monotonic() + self._grace_s
        while reported < self._store.add(f"{_PREFIX}/alarm", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
            reported = self._store.add(f"{_PREFIX}/reported", 0)

    def _alarm_raised(self) -> bool:
        try:
            return bool(self._beat_store.check([f"{_PREFIX}/alarm"]))
        except RuntimeError:
            return False

    def _publish(self, client: Any, kind: str, extra: dict[str, Any]) -> bool:
        record = {"time": time.time(), "issued": dict(self._issued), **self._identity, **extra}
        try:
            client.set(f"{_PREFIX}/{kind}/{self.rank}", json.dumps(record))
            return True
        except RuntimeError:
            return False

    def _fetch(self, kind: str, rank: int) -> dict[str, Any] | None:
        key = f"{_PREFIX}/{kind}/{rank}"
        try:
            return json.loads(self._store.get(key)) if self._store.check([key]) else None
        except RuntimeError:
            return None

    def diagnose(self, wait: Wait, waited: float) -> tuple[str, list[dict[str, Any]]]:
        """Publish this wait, give the peers `grace_s` to publish theirs, and describe who is missing.

        Returns the message and the heartbeats of the missing peers (whose stopped processes on
        this host are to be killed)."""
        published = self._publish(self._store, "wait", {"op": wait.op, "axis": wait.axis, "seq": wait.seq})
        try:
            self._store.add(f"{_PREFIX}/alarm", 1)
        except RuntimeError:
            published = False
        if not published:
            return self._unanswered(wait, waited), []
        peers = [r for r in wait.peers if r != self.rank]
        deadline = time.monotonic() + self._grace_s
        waits: dict[int, dict[str, Any]] = {}
        while True:
            waits.update({r: w for r in peers if r not in waits and (w := self._fetch("wait", r)) is not None})
            if len(waits) == len(peers) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        missing = [r for r in peers if r not in waits]
        behind = [r for r in peers if r in waits and not self._arrived(wait, waits[r])]
        parts = [self._head(wait, waited)]
        if missing:
            beats = {r: self._fetch("beat", r) for r in missing}
            detail = "; ".join(self._describe_missing(r, beats[r], wait.axis) for r in missing)
            parts.append(f"ranks {missing} did not arrive ({detail})")
        if behind:
            detail = "; ".join(
                f"rank {r} waits in #{waits[r]['seq']} {waits[r]['op']} on axis {waits[r]['axis']!r}" for r in behind
            )
            parts.append(f"ranks {behind} are alive but behind ({detail})")
        other_op = [r for r in peers if r in waits and r not in behind and (waits[r]["axis"], waits[r]["seq"]) ==
                    (wait.axis, wait.seq) and waits[r]["op"] != wait.op]
        if other_op:
            detail = "; ".join(f"rank {r} waits in #{wait.seq} {waits[r]['op']}" for r in other_op)
            parts.append(f"ranks {other_op} issued another collective as #{wait.seq} on this axis ({detail}): the ranks "
                         "issued different collectives, a program error (e.g. a rank running fewer forwards), not a stall")
        elif not missing and not behind:
            parts.append("every peer arrived: the communication library itself is stuck")
        return "; ".join(parts), [beats[r] for r in missing if beats[r] is not None]

    def _head(self, wait: Wait, waited: float) -> str:
        return f"rank {self.rank} waited {waited:.0f} s in {wait.describe()}"

    def _unanswered(self, wait: Wait, waited: float) -> str:
        peers = [r for r in wait.peers if r != self.rank]
        return (f"{self._head(wait, waited)}; the rendezvous store does not answer, so the peers {peers} "
                "cannot be asked (is this host cut off from the store's host?)")

    @staticmethod
    def _arrived(wait: Wait, peer: dict[str, Any]) -> bool:
        if not wait.collective:
            return False  # a point-to-point peer that is waiting anywhere is not in our exchange
        return peer["issued"].get(wait.axis, 0) >= wait.seq

    def _describe_missing(self, rank: int, beat: dict[str, Any] | None, axis: str) -> str:
        if beat is None:
            return f"rank {rank}: never seen"
        age = time.time() - beat["time"]
        state = ""
        if beat["host"] is not None and beat["host"] == self._identity["host"]:
            stat = _proc_stat(beat["pid"])
            if stat is None or stat[1] != beat["start"] or stat[0] in "ZX":
                state = ", its process has exited"
            elif stat[0] == "T":
                state = ", its process is stopped (SIGSTOP), so killed"
            else:
                state = f", its process is running (state {stat[0]}) outside any collective"
        return f"rank {rank}: last seen {age:.0f} s ago at #{beat['issued'].get(axis, 0)} on axis {axis!r}{state}"

    def _kill_if_stopped(self, beat: dict[str, Any]) -> None:
        """SIGKILL a peer on this host that is stopped: it would hold the agent for its shutdown grace."""
        if beat["host"] is None or beat["host"] != self._identity["host"]:
            return
        stat = _proc_stat(beat["pid"])
        if stat is not None and stat[0] == "T" and stat[1] == beat["start"]:
            try:
                os.kill(beat["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
