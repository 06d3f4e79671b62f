"""The phases of a run outside the training step, each with a deadline of its own.

A `Phase` (dist/watchdog.py) is data: a name, what it is doing, its deadline and the rule that gave
it. `Phases` makes them by the rules below and arms each on the watchdog for the code it covers
(`with ctx.phases.save(step, parameters): ...`); past its deadline the watchdog names the phase and
the ranks that did not arrive, on every live rank, and the process ends (torchrun's agent restarts
the group, or stops the run with `--max-restarts 0`). A rank that stalls there is thus named
within the deadline + the watchdog's grace (3 s), where it was found after `parallel.timeout_s`
(600 s) or never:

    start-up     parallel.startup_s for each step: joining the process group (rendezvous and group
                 creation, from the process's start when the worker says so, else from the call),
                 preparing the data (opening the token file), building the model, the first barrier
    evaluation   parallel.eval_s + 4 · (this rank's evaluation windows) · (seconds per window of
                 the last training step: forward and backward, so about 12× a forward's time)
    save, load   parallel.save_s + B / v, B = 16 bytes per parameter (fp32 weights and AdamW's two
                 moments: 12; the margin covers masters, RNG and metadata), v = parallel.save_mb_s or,
                 if lower, half the slowest speed (B / seconds) a save or load of this process reached.
                 Its waits may last as long as the phase: ranks wait for the slowest writer and for
                 rank 0's hashing of every file (the manifest)

Entering and leaving a phase is written to the rank log (RUN_DIR/logs/rank_N.log), with the
deadline, so a run's log shows where each rank was. Without a watchdog (one process) phases cost
nothing and write nothing. Cost with one: two store `set`s and two log lines per phase, none per step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

from ndtrain.config import ParallelConfig
from ndtrain.console import FILE_ONLY
from ndtrain.dist.watchdog import Phase, Watchdog

BYTES_PER_PARAMETER = 16
EVAL_SLACK = 4
MB = 1e6
log = logging.getLogger("ndtrain")


def process_started() -> float:
    """The `time.monotonic()` reading at which this process started (from /proc; now where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return time.monotonic()
    age = uptime - int(stat[stat.rindex(")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, age)


@dataclass
class Phases:
    """This process's phases: the deadlines of `config`, armed on `watchdog` (None: nothing is watched)."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    watchdog: Watchdog | None = None
    slowest_mb_s: float = math.inf  # the slowest save or load of this process so far

    def startup(self, detail: str, started: float | None = None) -> contextlib.AbstractContextManager[Phase]:
        """A step of start-up; `started`: when it began (default: now)."""
        began = time.monotonic() if started is None else started
        return self.watch(Phase("start-up", detail, self.config.startup_s, "parallel.startup_s", began))

    def evaluation(self, step: int, windows: int, window_s: float) -> contextlib.AbstractContextManager[Phase]:
        """The evaluation after `step` of `windows` windows on this rank; `window_s`: seconds per window
        of the last training step."""
        extra = EVAL_SLACK * windows * window_s
        rule = f"parallel.eval_s {self.config.eval_s:g} + {EVAL_SLACK} × {windows} windows × {window_s:.3f} s"
        return self.watch(Phase("evaluation", f"after step {step}", self.config.eval_s + extra, rule, time.monotonic()))

    def save(self, step: int, parameters: int) -> contextlib.AbstractContextManager[Phase]:
        return self._checkpoint("checkpoint save", f"of step {step}", parameters)

    def load(self, name: str, parameters: int) -> contextlib.AbstractContextManager[Phase]:
        return self._checkpoint("checkpoint load", f"of {name}", parameters)

    @contextlib.contextmanager
    def _checkpoint(self, name: str, detail: str, parameters: int) -> Iterator[Phase]:
        size = BYTES_PER_PARAMETER * parameters
        speed = min(self.config.save_mb_s, self.slowest_mb_s / 2)
        rule = f"parallel.save_s {self.config.save_s:g} + {size / MB:.1f} MB at {speed:.3g} MB/s"
        began = time.monotonic()
        with self.watch(Phase(name, detail, self.config.save_s + size / MB / speed, rule, began, long_waits=True)) as p:
            yield p
        if size:
            self.slowest_mb_s = min(self.slowest_mb_s, size / MB / max(time.monotonic() - began, 1e-9))

    @contextlib.contextmanager
    def watch(self, phase: Phase) -> Iterator[Phase]:
        """Arm `phase` on the watchdog for the duration, saying so in the rank log."""
        if self.watchdog is None:
            yield phase
            return
        rank = self.watchdog.rank
        with self.watchdog.phase(phase):  # published before the line, withdrawn after the closing one
            log.info(f"ndtrain: rank {rank} enters {phase.describe()} ({phase.deadline()})", extra=FILE_ONLY)
            yield phase
            log.info(f"ndtrain: rank {rank} leaves {phase.describe()} after {time.monotonic() - phase.started:.1f} s",
                     extra=FILE_ONLY)
