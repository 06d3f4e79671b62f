"""Peak memory of each contestant of a data-parallel bench alone in worker processes of its own.

Why: the timed contest (harness.py) alternates its contestants inside one set of workers, so a
run's resident-set peak also counts the glibc heap the runs before it grew: freed, handed back by
`malloc_trim`, then touched again as the run's allocations spread over it. In `bench zero1` (12.8 M
parameters, 2 ranks) ours' peak climbed from 632 to 710 MB over its runs while holding ~50 MB less
live memory (malloc's in-use bytes) than torch's at its peak: the in-contest peak says as much
about the order of the runs as about the strategy. So after the contest, `ndtrain bench` launches
the workers once more per contestant with `--memory-of NAME`: each process builds only that
contestant and runs W warmup + min(S, `MEMORY_STEPS`) steps, as a user's training process would,
and rank 0 writes every rank's peak, peak over the pre-build baseline and own share (harness.py's
definitions); they land in the result's summary as `fresh_memory` and in a table of their own.

Cost: one launch of the workers per contestant (their start-up, one build and a few steps); no
communication of its own beyond the contestant's and the harness's bookkeeping.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

from ndtrain.bench.harness import MB, MEMORY_STEPS, RunRecord


def record_memory(record: RunRecord) -> dict[str, list[int]]:
    """The per-rank memory figures of one run (the summary's keys, of this run alone)."""
    return {
        "peak_bytes": record.peak_bytes,
        "peak_over_baseline_bytes": record.over_baseline_bytes(),
        "peak_own_share_bytes": record.own_share_bytes(),
    }


def measure_each(launch: Callable[[list[str]], int], out: Path) -> int:
    """After a timed launch that wrote `out`: one `launch(["--memory-of", NAME, "--out", PATH])` per
    contestant in it; their figures are added to `out`'s summary and printed. The exit status of the
    first failed launch, else 0."""
    result = json.loads(out.read_text())
    for name in result["summary"]:
        with tempfile.TemporaryDirectory(prefix="ndtrain-memory-") as directory:
            path = Path(directory) / "memory.json"
            status = launch(["--memory-of", name, "--out", str(path)])
            if status != 0:
                return status
            result["summary"][name]["fresh_memory"] = json.loads(path.read_text())
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """Each contestant's fresh-process figures (largest rank) and its peak against the reference's."""
    options = result["options"]
    steps = options["warmup"] + min(options["steps"], MEMORY_STEPS)
    reference = max(result["summary"][result["reference"]]["fresh_memory"]["peak_bytes"])
    lines = [f"peak memory per rank, each contestant alone in fresh worker processes (build + {steps} steps)",
             f"{'contestant':<12}{'peak/rank':>11}{'over base':>11}{'own share':>11}{'vs ' + result['reference']:>12}"]
    for name, s in result["summary"].items():
        memory = s["fresh_memory"]
        peak = max(memory["peak_bytes"])
        lines.append(f"{name:<12}{peak / MB:>8.0f} MB{max(memory['peak_over_baseline_bytes']) / MB:>8.0f} MB"
                     f"{max(memory['peak_own_share_bytes']) / MB:>8.0f} MB{(peak - reference) / MB:>+9.0f} MB")
    return "\n".join(lines)
