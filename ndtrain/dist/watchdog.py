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

Phases. Work outside collectives has deadlines of its own: a `Phase` (start-up, evaluation, a
checkpoint save or load: its name, what it is doing, its deadline and the rule that gave it; the
rules are dist/phases.py's) is armed around that work and disarmed after it, on the same machinery:

    past the phase's deadline   the rank raises the alarm as for a wait; a rank that is in a phase
                                (or a wait) for more than a tick when the alarm is raised joins in
    a wait inside a phase       keeps `timeout_s`, unless the phase has `long_waits` (saves and loads:
                                peers wait for the slowest writer and for rank 0's hashing), then it
                                may last until the phase's deadline
    the diagnosis               names this rank's wait and phase; of the peers (the wait's, else the
                                whole world), who did not arrive (with the phase each published last:
                                a rank publishes a phase when it enters and when it leaves it) and who
                                is alive but elsewhere; every rank in the same phase means the phase is
                                slower than its deadline
    an exception leaving a      while a diagnosis is under way it is its consequence (a peer exited):
    phase                       held as in a failed wait

A rank that stopped before it reached the store (during rendezvous: it published nothing) is looked
up among the processes its agent started on this host (same parent, same TORCHELASTIC_RUN_ID, its
RANK), so it is named by its state and, if stopped, SIGKILLed too. The watchdog exists as soon as the
rank has the rendezvous store, before the process group: dist/mesh.py builds the group with that
store after starting the watchdog, so rendezvous and group creation are watched by the start-up
phase. Before that (connecting to the store; a rank 0 that serves the store itself waits in its
constructor for the others) only the store's own timeout, `parallel.timeout_s`, bounds the wait:
under ndtrain's launcher and torchrun's agent the workers are clients of the agent's store, which
is up before they start, so that step does not wait for peers.
Cost of a phase: two store `set`s (entering and leaving) from the main thread, bounded like the
diagnosis' store calls; nothing per step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

from ndtrain.dist.procfs import host_identity, local_worker, proc_stat

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


@dataclass(frozen=True)
class Phase:
    """A stretch of work every rank goes through with a deadline of its own (see the module docstring).

    `started` is a `time.monotonic()` reading; `rule` says how `deadline_s` was reached."""

    name: str
    detail: str
    deadline_s: float
    rule: str
    started: float
    long_waits: bool = False

    def describe(self) -> str:
        return f"{self.name}: {self.detail}"

    def deadline(self) -> str:
        return f"deadline {self.deadline_s:.0f} s: {self.rule}"


def _started(fn: Callable[[], None]) -> threading.Thread:
    """`fn` running on a daemon thread (a store call may block past its timeout); its errors count
    as not having finished."""

    def guarded() -> None:
        try:
            fn()
        except RuntimeError:
            pass

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    return thread


def _bounded(fn: Callable[[], None], seconds: float) -> None:
    """Run `fn` on a daemon thread for at most `seconds`."""
    _started(fn).join(seconds)


class Watchdog:
    """Turns a wait longer than `timeout_s`, or a phase past its deadline, on this rank into a
    diagnosis on every live rank of a world of `world_size`."""

    def __init__(
        self, rank: int, store: Any, timeout_s: float, issued: Mapping[str, int], *, world_size: int = 1,
        tick_s: float = 0.5, grace_s: float = 3.0,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.world = tuple(range(world_size))
        self._issued = issued  # the communicator's per-axis sequence numbers (read, never written)
        # the beat's may block for good; the phase's is the main thread's
        self._store, self._beat_store, self._phase_store = store.clone(), store.clone(), store.clone()
        for client in (self._store, self._beat_store, self._phase_store):
            client.set_timeout(timedelta(seconds=grace_s))
        self._tick_s = tick_s
        self._grace_s = grace_s
        self._beat_s = min(5.0, timeout_s / 4)
        self._armed: tuple[Wait, float] | None = None
        self._phase: Phase | None = None
        self._stalled = threading.Event()
        self._alarm = threading.Event()
        self._stop = threading.Event()
        self._publishes: list[threading.Thread] = []  # the phase publishes, for stop()
        self._publishes_lock = threading.Lock()  # a publish is listed before its store call can begin
        self._threads = [
            threading.Thread(target=self._monitor, name="ndtrain-watchdog", daemon=True),
            threading.Thread(target=self._beat, name="ndtrain-watchdog-beat", daemon=True),
        ]
        stat = proc_stat(os.getpid())
        self._identity = {"pid": os.getpid(), "host": host_identity(), "start": stat[1] if stat else None}

    def start(self) -> "Watchdog":
        """Publish the first heartbeat (so a rank that stalls at once is still known), then watch."""
        self._publish(self._beat_store, "beat", {})
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """End both threads. The beat thread and any phase publish still running are waited for, at
        most 2 · grace_s in all: a store call still running when the process exits returns into a
        finalizing interpreter, which ends its thread from inside the store's C++ code and aborts
        the process ("terminate called without an active exception", exit -6, of a rank that had
        finished). Only a store that does not answer at all (a cut link) outlasts the wait; such a
        thread is then left behind."""
        self._stop.set()
        self._threads[0].join()
        deadline = time.monotonic() + 2 * self._grace_s
        with self._publishes_lock:
            publishes = tuple(self._publishes)  # a phase publish may outlast its grace_s
        for thread in (self._threads[1], *publishes):
            thread.join(max(0.0, deadline - time.monotonic()))

    def arm(self, wait: Wait) -> None:
        self._armed = (wait, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[Phase]:
        """Watch `phase` for the duration (phases do not nest: the enclosing one is restored after)."""
        outer = self._phase
        self._publish_phase(phase)
        self._phase = phase
        try:
            yield phase
        except BaseException:
            self.hold_if_stalled()
            raise
        finally:
            self._phase = outer
            self._publish_phase(outer)

    def _publish_phase(self, phase: Phase | None) -> None:
        record = {"phase": phase.describe() if phase else None}
        with self._publishes_lock:  # started and listed at once, so a stop() on another thread sees it
            publish = _started(lambda: self._phase_store.set(f"{_PREFIX}/phase/{self.rank}", json.dumps(record)))
            self._publishes = [t for t in self._publishes if t.is_alive()] + [publish]
        publish.join(self._grace_s)

    def hold_if_stalled(self) -> None:
        """Called by a wait that failed: while a diagnosis is under way, the failure is its
        consequence (a peer exited first), so block until the watchdog ends the process."""
        if self._stalled.is_set():
            threading.Event().wait()

    def _busy_s(self, now: float) -> float:
        """How long this rank has been in its current wait or phase (0 when in neither)."""
        armed, phase = self._armed, self._phase
        return max(now - armed[1] if armed else 0.0, now - phase.started if phase else 0.0)

    def _overdue(self, now: float) -> bool:
        armed, phase = self._armed, self._phase
        if phase is not None and now - phase.started >= phase.deadline_s:
            return True
        return armed is not None and now - armed[1] >= self.timeout_s and not (phase and phase.long_waits)

    def _monitor(self) -> None:
        while not self._stop.wait(self._tick_s):
            armed, phase, now = self._armed, self._phase, time.monotonic()
            if (armed or phase) and (self._overdue(now) or (self._busy_s(now) >= self._tick_s and self._alarm.is_set())):
                self._stall(armed[0] if armed else None, now - armed[1] if armed else 0.0, phase, now)

    def _beat(self) -> None:
        next_beat = time.monotonic() + self._beat_s
        while not self._stop.wait(self._tick_s):
            now = time.monotonic()
            if self._busy_s(now) >= self._tick_s and self._alarm_raised():
                self._alarm.set()
            if now >= next_beat:
                self._publish(self._beat_store, "beat", {})
                next_beat = now + self._beat_s

    def _stall(self, wait: Wait | None, waited: float, phase: Phase | None, now: float) -> None:
        """Print the diagnosis as the command line's one error line; end the process once the
        other ranks that joined the diagnosis have printed theirs (at most `grace_s` later), so
        that the agent, which stops every worker when the first one exits, cuts no message off."""
        self._stalled.set()
        result: list[tuple[str, list[dict[str, Any]]]] = []
        spent = now - phase.started if phase else 0.0
        _bounded(lambda: result.append(self.diagnose(wait, waited, phase, spent)), 2 * self._grace_s)
        message, stopped = result[0] if result else (self._unanswered(wait, waited, phase, spent), [])
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

    def diagnose(self, wait: Wait | None, waited: float, phase: Phase | None = None,
                 spent: float = 0.0) -> tuple[str, list[dict[str, Any]]]:
        """Publish this wait (and phase), give the peers `grace_s` to publish theirs, and describe who
        is missing. Returns the message and the records (heartbeats, or processes found on this
        host) of the missing peers, whose stopped processes on this host are to be killed."""
        mine: dict[str, Any] = {"phase": phase.describe() if phase else None}
        if wait is not None:
            mine.update(op=wait.op, axis=wait.axis, seq=wait.seq)
        published = self._publish(self._store, "wait", mine)
        try:
            self._store.add(f"{_PREFIX}/alarm", 1)
        except RuntimeError:
            published = False
        if not published:
            return self._unanswered(wait, waited, phase, spent), []
        peers = [r for r in (wait.peers if wait is not None else self.world) if r != self.rank]
        deadline = time.monotonic() + self._grace_s
        waits: dict[int, dict[str, Any]] = {}
        while True:
            waits.update({r: w for r in peers if r not in waits and (w := self._fetch("wait", r)) is not None})
            if len(waits) == len(peers) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        missing = [r for r in peers if r not in waits]
        behind = [r for r in peers if r in waits and not self._arrived(wait, phase, waits[r])]
        parts = [self._head(wait, waited, phase, spent)]
        found: dict[int, dict[str, Any] | None] = {}
        if missing:
            found = {r: self._fetch("beat", r) or local_worker(r) for r in missing}
            detail = "; ".join(self._describe_missing(r, found[r], wait.axis if wait else None) for r in missing)
            parts.append(f"ranks {missing} did not arrive ({detail})")
        if behind:
            detail = "; ".join(f"rank {r} {self._whereabouts(waits[r])}" for r in behind)
            parts.append(f"ranks {behind} are alive but behind ({detail})")
        other_op = [] if wait is None else [
            r for r in peers if r in waits and r not in behind and (waits[r].get("axis"), waits[r].get("seq")) ==
            (wait.axis, wait.seq) and waits[r].get("op") != wait.op]
        if other_op and wait is not None:
            detail = "; ".join(f"rank {r} waits in #{wait.seq} {waits[r]['op']}" for r in other_op)
            parts.append(f"ranks {other_op} issued another collective as #{wait.seq} on this axis ({detail}): the ranks "
                         "issued different collectives, a program error (e.g. a rank running fewer forwards), not a stall")
        elif not missing and not behind and wait is not None:
            parts.append("every peer arrived: the communication library itself is stuck")
        elif not missing and not behind and phase is not None:
            parts.append(f"every rank is in this phase: it takes longer than its deadline ({phase.rule}): raise it")
        return "; ".join(parts), [b for r in missing if (b := found[r]) is not None]

    def _head(self, wait: Wait | None, waited: float, phase: Phase | None, spent: float) -> str:
        head = f"rank {self.rank}"
        if wait is not None:
            head += f" waited {waited:.0f} s in {wait.describe()}"
        if phase is not None:
            head += f" during {phase.describe()}" if wait else f" spent {spent:.0f} s in {phase.describe()}"
            head += f" ({phase.deadline()})"
        return head

    def _unanswered(self, wait: Wait | None, waited: float, phase: Phase | None, spent: float) -> str:
        peers = [r for r in (wait.peers if wait is not None else self.world) if r != self.rank]
        return (f"{self._head(wait, waited, phase, spent)}; the rendezvous store does not answer, so the peers {peers} "
                "cannot be asked (is this host cut off from the store's host?)")

    @staticmethod
    def _arrived(wait: Wait | None, phase: Phase | None, peer: dict[str, Any]) -> bool:
        if wait is None:  # a phase: a peer arrived when it is in the same phase
            return phase is not None and peer.get("phase") == phase.describe()
        if not wait.collective or "axis" not in peer:
            return False  # a point-to-point peer that is waiting anywhere is not in our exchange
        return peer["issued"].get(wait.axis, 0) >= wait.seq

    @staticmethod
    def _whereabouts(peer: dict[str, Any]) -> str:
        where = f"waits in #{peer['seq']} {peer['op']} on axis {peer['axis']!r}" if "axis" in peer else \
            "is outside any collective"
        return where + (f" during {peer['phase']}" if peer.get("phase") else "")

    def _describe_missing(self, rank: int, beat: dict[str, Any] | None, axis: str | None) -> str:
        if beat is None:
            return f"rank {rank}: never seen"
        state = ""
        if beat["host"] is not None and beat["host"] == self._identity["host"]:
            stat = proc_stat(beat["pid"])
            if stat is None or stat[1] != beat["start"] or stat[0] in "ZX":
                state = ", its process has exited"
            elif stat[0] == "T":
                state = ", its process is stopped (SIGSTOP), so killed"
            else:
                state = f", its process is running (state {stat[0]}) outside any collective"
        if "time" not in beat:  # found on this host, never reached the store
            return f"rank {rank}: never seen (pid {beat['pid']} never reached the rendezvous store){state}"
        seen = f"last seen {time.time() - beat['time']:.0f} s ago"
        if axis is not None:
            seen += f" at #{beat['issued'].get(axis, 0)} on axis {axis!r}"
        phase = (self._fetch("phase", rank) or {}).get("phase")
        return f"rank {rank}: {seen}{state}" + (f", last in {phase}" if phase else "")

    def _kill_if_stopped(self, beat: dict[str, Any]) -> None:
        """SIGKILL a peer on this host that is stopped: it would hold the agent for its shutdown grace."""
        if beat["host"] is None or beat["host"] != self._identity["host"]:
            return
        stat = proc_stat(beat["pid"])
        if stat is not None and stat[0] == "T" and stat[1] == beat["start"]:
            try:
                os.kill(beat["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
