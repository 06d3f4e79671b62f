"""Per-step progress: a tqdm bar on a terminal, otherwise one log line every `log.every` steps.

`log.progress` chooses: "auto" (the bar when the console's stderr is a terminal, lines when it is a
pipe or file), "bar", "lines" or "off". Whatever the console shows, every `log.every` steps (and
at the last step) one line such as

    step 50/200 | loss 2.274 | val 2.361 | lr 2.9e-03 | gnorm 0.90 | 7,400 tok/s | 0.55 s/step | mem 742 MiB | eta 1m30s

goes to the "ndtrain" logger: to the console in "lines" mode, to the rank's log file in every mode
(see `console.py`). Throughput, seconds per step and the ETA are wall-clock averages over the
steps since the previous line (evaluation and checkpoints included); memory is this rank's peak
over those steps. Throughput is in the task's unit (`Task.unit`: "tok/s" for tokens, "images/s" for
the digits task's images), as is the bar's rate field.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from ndtrain.console import FILE_ONLY, log
from ndtrain.config.options import ProgressMode


def format_eta(seconds: float) -> str:
    """45s, 1m30s, 2h05m, 3d04h; '?' when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_memory(n_bytes: float) -> str:
    """742 MiB below 10 GiB, 12.3 GiB above."""
    if n_bytes < 10 * 2**30:
        return f"{n_bytes / 2**20:,.0f} MiB"
    return f"{n_bytes / 2**30:,.1f} GiB"


def rate_label(unit: str) -> str:
    """How a rate of `unit` per second is written: tok/s, images/s."""
    return f"{'tok' if unit == 'tokens' else unit}/s"


def format_line(step: int, total: int, *, loss: float, val: float | None = None, lr: float | None = None,
                grad_norm: float | None = None, tokens_per_s: float | None = None, s_per_step: float | None = None,
                mem_bytes: int | None = None, eta_s: float | None = None, unit: str = "tokens") -> str:
    """One progress line; fields that are None are left out. `tokens_per_s` counts `unit` (the task's)."""
    parts = [f"step {step}/{total}", f"loss {loss:.3f}"]
    if val is not None:
        parts.append(f"val {val:.3f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    if grad_norm is not None:
        parts.append(f"gnorm {grad_norm:.2f}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} {rate_label(unit)}")
    if s_per_step is not None:
        parts.append(f"{s_per_step:.2f} s/step" if s_per_step < 10 else f"{s_per_step:,.1f} s/step")
    if mem_bytes:
        parts.append(f"mem {format_memory(mem_bytes)}")
    if eta_s is not None:
        parts.append(f"eta {format_eta(eta_s)}")
    return " | ".join(parts)


def resolve_mode(mode: ProgressMode, stream: TextIO) -> ProgressMode:
    """"auto" → "bar" on a terminal, "lines" otherwise; the other modes as given."""
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


class Progress:
    """Called once per finished step by the trainer, on every rank; the bar is drawn by rank 0 only.

    `stream` is the console's stderr (the bar's stream, and what "auto" tests for a terminal); `unit`
    what `update`'s `tokens` count (the task's unit).
    """

    def __init__(self, mode: str, every: int, total: int, start: int, main: bool, stream: TextIO | None = None,
                 unit: str = "tokens") -> None:
        stream = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(mode, stream)
        self.unit = unit
        self.every, self.total = every, total
        self.val: float | None = None
        self.bar = None
        if main and self.mode == "bar":
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=stream)
        self._since_step, self._since_time = start, time.perf_counter()
        self._tokens, self._peak = 0, 0

    def update(self, step: int, *, loss: float, tokens: int = 0, val: float | None = None, lr: float | None = None,
               grad_norm: float | None = None, mem_bytes: int = 0) -> None:
        """Step `step` (1-based) is done; `val` is given on the steps that evaluated."""
        if val is not None:
            self.val = val
        self._tokens += tokens
        self._peak = max(self._peak, mem_bytes)
        if self.bar is not None:
            postfix: dict[str, Any] = {"loss": f"{loss:.3f}"}
            if self.val is not None:
                postfix["val"] = f"{self.val:.3f}"
            if tokens:
                rate = self._tokens / max(time.perf_counter() - self._since_time, 1e-9)
                postfix[rate_label(self.unit).replace("/", "_")] = f"{rate:,.0f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        if step % self.every and step != self.total:
            return
        now = time.perf_counter()
        steps, wall = step - self._since_step, now - self._since_time
        per_step = wall / steps if steps > 0 else None
        line = format_line(
            step, self.total, loss=loss, val=self.val, lr=lr, grad_norm=grad_norm,
            tokens_per_s=self._tokens / wall if tokens and wall > 0 else None, s_per_step=per_step,
            mem_bytes=self._peak, eta_s=(self.total - step) * per_step if per_step is not None else None,
            unit=self.unit,
        )
        log.info(line, extra=None if self.mode == "lines" else FILE_ONLY)
        self._since_step, self._since_time, self._tokens, self._peak = step, now, 0, 0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
