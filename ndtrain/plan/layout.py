"""A candidate layout and the structural rules it must obey before its cost is worth computing.

world = dp × cp × pp × tp (tp fastest, then pp, then cp, then dp: DESIGN.md), so
    tp group   stride 1
    pp group   stride tp
    cp group   stride tp·pp
    dp×cp      stride tp·pp (the group that synchronises gradients and shards ZeRO state)
Micro-batches per step and data-parallel rank: m = B / (dp · mbs), B the global batch in sequences.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ndtrain.config.options import PP_SCHEDULES as SCHEDULES
from ndtrain.config.options import RECOMPUTE_MODES as RECOMPUTE
from ndtrain.plan.arch import ModelSpec


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int
    zero: int
    mbs: int
    vpp: int
    recompute: str
    sp: bool
    schedule: str  # "none" when pp = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def chunk_layers(self, layers: int) -> int:
        """Layers of the largest model chunk: stages may be uneven, the slowest one sets the pace."""
        return math.ceil(layers / (self.pp * self.vpp))

    def stage_layers(self, layers: int) -> int:
        return self.chunk_layers(layers) * self.vpp

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f"×{self.vpp}" if self.vpp > 1 else "")
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} cp{self.cp} z{self.zero} mbs{self.mbs}{sched} "
                f"rc={self.recompute}{' sp' if self.sp else ''}")


@dataclass(frozen=True)
class Problem:
    kind: str  # a short category, for counting rejections
    message: str


def problem(layout: Layout, model: ModelSpec, gpus: int, global_batch: int) -> Problem | None:
    """Why this layout cannot run this model on `gpus` ranks with this batch, or None."""
    if layout.world != gpus:
        axes = f"{layout.dp}×{layout.cp}×{layout.pp}×{layout.tp}"
        return Problem("world", f"dp×cp×pp×tp = {axes} = {layout.world} ≠ --gpus {gpus}")
    if model.heads % layout.tp:
        return Problem("tp-heads", f"tp={layout.tp} does not divide the {model.heads} attention heads")
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        return Problem("tp-kv-heads", f"tp={layout.tp} and the {model.kv_heads} kv heads do not divide one another")
    if layout.pp * layout.vpp > model.layers:
        return Problem("pp-layers", f"pp×vpp = {layout.pp * layout.vpp} exceeds the {model.layers} layers")
    if layout.cp > 1 and model.seq % (2 * layout.cp):
        return Problem("cp-seq", f"cp={layout.cp}: sequence {model.seq} is not divisible by 2·cp (ring chunks)")
    if global_batch % (layout.dp * layout.mbs):
        return Problem("batch", f"global batch {global_batch} is not divisible by dp×mbs = {layout.dp}×{layout.mbs}")
    if layout.sp and layout.tp == 1:
        return Problem("sp", "sequence parallel needs tp > 1")
    if layout.zero not in (0, 1, 2, 3):
        return Problem("zero", f"zero={layout.zero} is not a ZeRO stage (0-3)")
    if layout.recompute not in RECOMPUTE:
        return Problem("recompute", f"recompute={layout.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    return _schedule_problem(layout, layout.micro_batches(global_batch))


def _schedule_problem(layout: Layout, micro_batches: int) -> Problem | None:
    if layout.pp == 1:
        if layout.schedule != "none" or layout.vpp != 1:
            return Problem("schedule", "pp=1 has no pipeline schedule or virtual stages")
        return None
    if layout.schedule not in SCHEDULES:
        return Problem("schedule", f"schedule={layout.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if layout.schedule == "interleaved":
        if layout.vpp < 2:
            return Problem("schedule", "the interleaved schedule needs vpp ≥ 2")
        if micro_batches % layout.pp:
            return Problem("schedule", f"interleaved: {micro_batches} micro-batches: not a multiple of pp={layout.pp}")
    elif layout.vpp != 1:
        return Problem("schedule", f"vpp={layout.vpp} needs the interleaved schedule")
    if layout.schedule in ("1f1b", "zb") and micro_batches < layout.pp:  # as ndtrain's pipeline refuses it
        return Problem("schedule", f"{layout.schedule}: {micro_batches} micro-batches < pp={layout.pp} (needs m ≥ p)")
    return None
