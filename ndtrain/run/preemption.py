"""Preemption: SIGTERM/SIGINT become a stop request that every rank honours after the same step.

A signal handler only records the signal (the first one; a repeat, e.g. the agent forwarding what
the terminal already delivered, changes nothing), so no rank is interrupted inside a collective or
a checkpoint write. Once per step the training loop calls `StopRequest.agreed`, a one-element
all-reduce MAX of the recorded signal over the world group (4 bytes per rank per step, outside the
engine's step, so a step's counted communication is unchanged): every rank learns the same answer
after the same step, writes the checkpoint of that step with the others and raises `Preempted`.
The command then exits with status 128 + signal number (143 for SIGTERM, 130 for SIGINT), the
shell's convention for "ended by that signal".

On CUDA the flag is not read right away (that `.item()` would wait for the whole step's kernels, a
second host synchronisation per step): the all-reduce is issued, its result copied to page-locked
host memory behind an event, and read after the *next* step, when the event has long completed.
Every rank reads the same generation of the flag, so all still stop after the same step, one step
later than on CPU.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ndtrain.dist.comm import Communicator, Group

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by signal `signum`: 128 + signum."""
    return 128 + signum


class Preempted(Exception):
    """Every rank stopped after `step` because of `signum`; checkpoint `checkpoint` holds that step."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(self.message())

    def message(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} at step {self.step}; checkpoint "
                f"{self.checkpoint} written; re-run the same command to continue")


class StopRequest:
    """While entered, SIGTERM and SIGINT are recorded instead of ending the process.

    Handlers can only be installed from the main thread; elsewhere (a test calling the trainer
    on a thread) the signals keep their previous behaviour and no stop is ever requested.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._in_flight: tuple[torch.Tensor, Any] | None = None  # CUDA: the last step's flag on the host, its event

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agreed(self, comm: Communicator, group: Group, device: torch.device) -> int:
        """The signal some rank of `group` received (0 if none): the same value on every rank (on CUDA,
        the answer of the previous call's all-reduce: see the module docstring)."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        if device.type != "cuda":
            comm.all_reduce(flag, group, op=dist.ReduceOp.MAX)
            return int(flag.item())
        pending = comm.all_reduce(flag, group, op=dist.ReduceOp.MAX, async_op=True)
        if pending is not None:
            pending.wait()  # NCCL: the stream waits, the host does not
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._in_flight = self._in_flight, (host, event)
        if previous is None:
            return 0
        previous[1].synchronize()
        return int(previous[0].item())
