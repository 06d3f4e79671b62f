"""The gradient-synchronisation hooks a pipeline runner is handed for each stage chunk it runs.

The runner (runner.py) never asks what wraps a stage: the data-parallel strategy hands it one
`StageHooks` per chunk (`DataParallelStrategy.stage_hooks`), as Megatron's `schedules.py` is handed
`no_sync_func` / `grad_sync_func`, and the runner only calls them:

- `no_sync`: the context of a backward that is not the chunk's last in the step, for a strategy
  that accumulates gradients locally and synchronises their sum once (DDP, ZeRO-1: the chunk's last
  backward all-reduces or reduce-scatters). None: every backward is complete as it is (nothing to
  synchronise, or sharded gradients reduced every micro-batch: ZeRO-2/3).
- `gradients_sharded`: each micro-batch's gradient is reduced into this rank's shard (ZeRO-2/3):
  a pipeline-tied weight's two copies are then summed from the shards (tied_shards.py, which reads
  the wrapper's `grad_segments()`), not as whole `.grad`s.
- `input_pass`: the context of zb's input-gradient pass I (ZeRO-3 gathers the weights I needs).
- `weight_pass`: the context that makes zb's weight pass W (one autograd call per weight operation)
  one synchronising backward; it yields None or `before(params)`, called ahead of each call (ZeRO-3
  gathers the unit holding `params`). None: W's calls need nothing around them.

The defaults are a bare stage's: no data parallelism around it. A strategy's hooks call its chunk's
methods at each use (`lambda: chunk.no_sync()`), so whatever the chunk holds then is what runs.
Nothing here communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn

BeforeWeights = Callable[[list[nn.Parameter]], None]


@dataclass(frozen=True)
class StageHooks:
    """What the runner may call around one stage chunk's backward passes (see the module docstring)."""

    no_sync: Callable[[], AbstractContextManager[None]] | None = None
    gradients_sharded: bool = False
    input_pass: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    weight_pass: Callable[[], AbstractContextManager[BeforeWeights | None]] | None = None
