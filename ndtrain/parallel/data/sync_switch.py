"""The switch behind `no_sync()`: whether a backward pass synchronises gradients (DDP, ZeRO-3).

Inside `off()` a strategy communicates nothing in backward: gradients accumulate locally (DDP's
buckets, ZeRO-3's full unit gradients) and the next backward outside synchronises their sum, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class SyncSwitch:
    """`enabled` is read by the strategy's backward hooks; `off()` clears it for a block."""

    def __init__(self) -> None:
        self.enabled = True

    @contextmanager
    def off(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside synchronises the sum."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous
