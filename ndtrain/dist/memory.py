"""Peak memory of this process: device allocator peak on CUDA, peak resident set (VmHWM) on CPU.

On Linux the CPU peak can be reset by writing 5 to /proc/self/clear_refs, so a peak can be
measured per phase (per training step, per benchmark run). The CPU figure includes the
process's own baseline (interpreter, torch libraries), reported separately by `baseline_bytes`.

The resident set counts a shared-memory page (dist/host_slots.py) in full in every process that maps
it: `shared_overcount_bytes` is how much more than its proportional share (the page divided by
the processes mapping it: Linux's PSS) this process's resident set counts, so that a per-rank
peak can be stated without counting one physical page once per rank.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")


def _status_kib(field: str, path: Path = _STATUS) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux: the peak stays the process lifetime peak


def peak_bytes(device: torch.device) -> int:
    """Peak bytes since the last `reset_peak` (CUDA allocator, or CPU resident set)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def release_freed_host_memory() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's `malloc_trim(0)`; a no-op where the C
    library has none). glibc keeps freed memory resident: after a rank built the whole model and kept
    its share (tp, pp, ZeRO-3 shards), the rest would stay in its resident set for the whole run."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def shared_overcount_bytes() -> int:
    """Bytes of shared-memory pages the resident set counts beyond this process's share of them
    (RssShmem − Pss_Shmem; 0 where Linux does not tell, and on CUDA's allocator figures)."""
    rss, pss = _status_kib("RssShmem"), _status_kib("Pss_Shmem", _SMAPS_ROLLUP)
    return 0 if rss is None or pss is None else max(0, rss - pss) * 1024


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (moments, step counters) held by this process."""
    return sum(
        tensor_bytes(t) for per_param in optimizer.state.values() for t in per_param.values() if isinstance(t, torch.Tensor)
    )
