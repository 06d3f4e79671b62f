"""Starting workers: local processes under torchrun's elastic agent, or joining an external torchrun.

`ndtrain train --nproc N` re-runs the same command line as `python -m ndtrain ...` on N local
workers through `torch.distributed.launcher` (the agent behind `torchrun`, rendezvous on
127.0.0.1). A process started by torchrun (ours or the user's, single or multi node) sees
torchrun's environment and runs as a worker directly.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid

import torch

from ndtrain.errors import UserError


def in_worker() -> bool:
    """True when this process was started by torchrun (ours or external)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def set_worker_threads(threads: int) -> int:
    """Intra-op threads for this process: `threads`, or the cores shared evenly by the local workers."""
    if threads <= 0:
        local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local_workers)
    torch.set_num_threads(threads)
    return threads


def launch_local(argv: list[str], nproc: int) -> int:
    """Run `python -m ndtrain *argv` on `nproc` local workers; return the exit status to report.

    A worker that exits with status 2 (a user error it has already printed) makes the launch
    return 2; any other failure returns 1 after naming the failed ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker then sets its own thread count
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ndtrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    with tempfile.TemporaryDirectory(prefix="ndtrain-launch-") as log_dir:
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(log_dir, "error.json"))
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "ndtrain", *argv)
        except ChildFailedError as e:
            codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
            if any(code == 2 for code in codes.values()):
                return 2
            details = ", ".join(f"rank {r} exit code {c}" for r, c in sorted(codes.items()))
            print(f"ndtrain: error: worker failure ({details}); see the worker output above", file=sys.stderr)
            return 1
    return 0
