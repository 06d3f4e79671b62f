"""ZeRO-3 under the zero-bubble schedule: the passes of a split backward (pipeline/split_backward.py).

zb splits a stage's backward into I, the input gradient only (one autograd call that reaches no
weight), and W, the weight gradients, run later as one autograd call per weight operation. A
plain backward of `FullyShardedDataParallel` (zero3_parameters.py) gathers each unit when the
backward reaches it, reduce-scatters it once its gradients are in and ends at the autograd
engine's end-of-backward callback; neither pass fits that, so the runner wraps them:

- `input_pass()` around I: each unit is gathered when I reaches it (the input gradient needs the
  weights) and the previous one prefetched; nothing is attached or reduced, and every unit is
  freed when I ends. The forward stays queued for its W.
- `weight_pass()` around W: takes the oldest waiting forward's units (W runs in forward order),
  and yields `before(params)`, which W calls ahead of each weight operation: it gathers the unit
  holding `params` and points its `.grad`s at its flat gradient. A unit whose gradients are all
  in is reduce-scattered and freed as in a backward; the end of the pass reduces the rest (zero
  gradients) and waits, as the end-of-backward callback would.

Cost against 1F1B's backward: one more all-gather per unit and micro-batch ((N−1)/N·Ψ'ᵤ·c bytes
each); W's gathers are not prefetched. Memory: as a backward, about one gathered unit at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


class SplitBackwardPasses:
    """Mixed into `FullyShardedDataParallel`, whose backward state it drives (`_forwards`,
    `_awaiting`, `_end_backward`...); `_split` is "input" or "weight" inside a pass, else None."""

    _split: str | None
    _unit_of: dict[int, Any]  # id(parameter) -> its FlatUnit

    @contextlib.contextmanager
    def input_pass(self) -> Iterator[None]:
        """zb's I (see the module docstring)."""
        self._split = "input"
        try:
            yield
        finally:
            self._split = None
            for unit in self.units:  # type: ignore[attr-defined]
                unit.free()

    @contextlib.contextmanager
    def weight_pass(self) -> Iterator[Callable[[list[nn.Parameter]], None]]:
        """zb's W of the oldest waiting forward (see the module docstring)."""
        forwards = self._forwards  # type: ignore[attr-defined]
        self._awaiting = forwards.popleft() if forwards else []
        self._split = "weight"
        try:
            yield self._gather_for_weights
        finally:
            self._split = None
            self._end_backward()  # type: ignore[attr-defined]

    def _gather_for_weights(self, params: list[nn.Parameter]) -> None:
        for unit in {id(u): u for u in (self._unit_of[id(p)] for p in params)}.values():
            if unit in self._awaiting:
                unit.wait()
                unit.attach_grads()
        self._track()  # type: ignore[attr-defined]

    def _split_pre_backward(self, block: Any) -> None:
        """A unit's pre-backward hook inside a pass (`block` None: the root's)."""
        unit = self.root if block is None else block  # type: ignore[attr-defined]
        if self._split == "weight":
            self._gather_for_weights(unit.params if unit is not None else [])
            return
        if unit is not None:
            unit.wait()
        order = self._order  # type: ignore[attr-defined]
        previous = (order[-1] if order else None) if block is None else self._previous(block)  # type: ignore[attr-defined]
        if previous is not None:
            previous.gather()
        self._track()  # type: ignore[attr-defined]
