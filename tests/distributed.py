"""Run a function on N gloo worker processes with a hard timeout (a hang fails, never freezes).

Workers rendezvous through a FileStore in a fresh temporary directory (no port races), each with
one thread, and return picklable results to the parent, which re-raises a worker's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

DEFAULT_TIMEOUT_S = 120.0


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store: str, results: Any, args: tuple) -> None:
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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, results, args)) for r in range(world_size)]
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
                    died = [f"rank {r} exited with status {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
                    if died:  # a worker that died (not one that returned or raised) sends nothing
                        failures.append(", ".join(died))
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


def init_method() -> str:
    """The rendezvous of the current test worker, for `ndtrain.mesh.init(..., init_method=...)`."""
    return os.environ["NDTRAIN_TEST_INIT_METHOD"]
