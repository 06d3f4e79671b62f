"""Run a function on N gloo worker processes with a hard timeout (a hang fails, never freezes).

Workers rendezvous through a FileStore in a fresh temporary directory (no port races), each with
one thread, and return picklable results to the parent, which re-raises a worker's traceback.
They are forked from a forkserver that imported torch and ndtrain once (`multiprocessing`'s
"forkserver" start method with those modules preloaded), not spawned: a spawned worker imports
torch again (~2.5 s of CPU), which over the suite's spawns of 2-8 workers on 2 cores was minutes.
The forkserver holds no threads and no CUDA context, and a worker takes the parent's environment
and standard output and error of the moment (as a spawned one would), not the forkserver's: a
test reading what workers print (pytest's `capfd`) sees it.

A matrix of cases (layouts, strategies) runs in one spawn: the worker runs every case with
`run_each`, which keeps a failing case's traceback as its result and goes on to the next case; in the
parent, one test per case reads its own result with `case_result` (so the first failure hides none).
Where cases need different spawns (world sizes, layouts), a module fixture's `Spawns` starts each
spawn once, at the first case that needs it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from multiprocessing import reduction
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, TypeVar

import torch

DEFAULT_TIMEOUT_S = 120.0
Case = TypeVar("Case", bound=Hashable)


PRELOAD = ["torch", "torch.distributed", "ndtrain"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _ParentFd:
    """A descriptor of the parent, duplicated into the worker when the worker's arguments are sent."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store: str, results: Any, args: tuple,
            environ: dict[str, str], output: tuple[int, int]) -> None:
    for fd, target in zip(output, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ["NDTRAIN_TEST_INIT_METHOD"] = f"file://{store}"
    torch.set_num_threads(1)
    try:
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # plain bytes: tensors must not travel through shared memory
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Call `fn(*args)` on `world_size` fresh processes; return the results ordered by rank.

    `fn` must be a module-level function. Inside it, `init_method()` gives the rendezvous.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        environ = dict(os.environ)
        output = (_ParentFd(1), _ParentFd(2))
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, results, args, environ, output))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        failures: list[str] = []
        try:
            deadline = time.monotonic() + timeout
            while len(collected) + len(failures) < world_size:
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue.Empty:
                    if any(p.exitcode for p in procs):  # a worker that died (not one that returned or raised) sends nothing
                        failures.append(_deaths(procs))
                        break
                    if time.monotonic() < deadline:
                        continue
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang?)") from None
                if ok:
                    collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures.append(f"--- rank {rank} ---\n{value}")
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise AssertionError("worker failed:\n" + "\n".join(failures))
    return [collected[r] for r in range(world_size)]


def _deaths(procs: list[Any], grace_s: float = 5.0) -> str:
    """The exit statuses of the workers that died, once the others ended too or `grace_s` passed: a
    death often ends the rest (a watchdog kills a stopped peer, then exits), and all belong in the report."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    return ", ".join(f"rank {r} exited with status {p.exitcode}" for r, p in enumerate(procs) if p.exitcode)


def init_method() -> str:
    """The rendezvous of the current test worker, for `ndtrain.dist.mesh.init(..., init_method=...)`."""
    return os.environ["NDTRAIN_TEST_INIT_METHOD"]


class Spawns:
    """`run_distributed` once per key, at its first use; a failed spawn fails every later use without rerunning."""

    def __init__(self, fn: Callable[..., Any], timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._fn, self._timeout = fn, timeout
        self._runs: dict[Any, list[Any] | AssertionError] = {}

    def get(self, key: Any, world_size: int, *args: Any) -> list[Any]:
        """The results of `fn(*args)` on `world_size` processes, spawned the first time `key` is asked for."""
        if key not in self._runs:
            try:
                self._runs[key] = run_distributed(self._fn, world_size, *args, timeout=self._timeout)
            except AssertionError as error:
                self._runs[key] = error
        run = self._runs[key]
        if isinstance(run, AssertionError):
            raise AssertionError(f"the spawn of {key!r} failed:\n{run}")
        return run


@dataclass(frozen=True)
class CaseError:
    """A case that raised in a worker: its traceback, kept as the case's result."""

    traceback: str


def run_each(fn: Callable[[Case], Any], names: Iterable[Case]) -> dict[Case, Any]:
    """In a worker: `{name: fn(name)}` over the cases, an exception becoming that case's `CaseError`.

    A case that fails on every rank alike lets the next case run; one that fails on some ranks only
    can leave the others waiting in a collective, and the runner's timeout then fails every case.
    """
    out: dict[Case, Any] = {}
    for name in names:
        try:
            out[name] = fn(name)
        except Exception:
            out[name] = CaseError(traceback.format_exc())
    return out


def case_result(results: list[dict[Any, Any]], name: Hashable) -> list[Any]:
    """In the parent: case `name`'s result on each rank; fail with the worker's traceback if it raised."""
    for rank, result in enumerate(results):
        if isinstance(result[name], CaseError):
            raise AssertionError(f"{name} failed on rank {rank}:\n{result[name].traceback}")
    return [result[name] for result in results]
