"""ZeRO stage 3 (FSDP): parameters, gradients and optimizer state sharded over the data-parallel ranks.

What is split: everything. The module is cut into wrapping units: the outermost modules the `wrap`
patterns select (zero3_wrap.py; "auto", the default: one unit per decoder layer), plus the root
unit of every parameter left over (embedding, final norm, head). Each unit is a `FlatUnit`
(zero3_unit.py): a flat fp32 buffer padded to a multiple of N (the size of `ctx.group("dp_cp")`)
of which each rank keeps 1/N, with its gradient; the optimizer sees only those shards
(`parameter_groups`), so its state is sharded too. The engine drives it through `FSDPStrategy`
(zero3_strategy.py).
Under tensor parallel the units are built on the tp-sharded model: a unit's flat buffer holds this
tp rank's slices (and the tp-replicated parameters, whose partial gradients parallel/model/tensor.py's hooks sum
over tp before they reach the flat gradient), sharded further over dp×cp; each segment keeps its
`Placement`, so the norm counts a slice once per tp rank and a replicated parameter once, and
`full_state_dict` gathers the slices over tp too.

What is communicated, and when (U units besides the root, N ranks):
- forward: the root is all-gathered when the forward starts and stays gathered until its
  gradient is reduced. Just before a unit's forward its all-gather is waited for (or issued),
  and the next unit's (in the execution order recorded on the first forward) is launched
  asynchronously, so it overlaps this unit's compute; after the forward the unit's parameters are
  freed (`reshard_after_forward=True`) or kept for backward (False). At most two units besides
  the root are gathered at once.
- backward: a hook on a unit's outputs fires just before its backward: the unit is gathered again
  if it was freed, its `.grad`s become views of one flat gradient buffer, and the previous unit's
  all-gather is launched (prefetch in reverse order). When every parameter of the unit has its
  gradient, the buffer is reduce-scattered (in `reduce_dtype`) asynchronously; it is waited for
  when the next unit's is launched, or at the end of backward, and its mean over the N ranks is
  added to the shard's fp32 `.grad`. The full parameters and gradient are then freed.
- transport: gloo's (or NCCL's) all-gather and reduce-scatter; on one CPU host (`host_slots`, the
  engine's default there: `parallel.host_shared_memory`) both go through one `SlotRing` per wrapper
  (dist/host_stream.py: two shared-memory segments of N slots of N·2^18 elements, taken in turn by rounds
  of 2^18 elements of every rank's range), in the order they are started, the same on every rank,
  for the operations in the ring's dtype (the compute dtype): same bytes, no socket.
- inside `no_sync()` nothing is reduced: the full gradients stay and accumulate, and the first
  backward outside reduces the sum (exact gradient accumulation, at the memory of unsharded
  gradients in the compute dtype).

Cost per training step, Ψ' padded elements (Σ units), c and r the compute and reduction itemsizes:
all-gathers (U+1) + U·[reshard_after_forward] calls moving (N−1)/N·Ψ'_·c bytes each (Ψ'_ of the
unit), reduce-scatters U+1 calls of (N−1)/N·Ψ'_·r bytes; i.e. about (2 + 1)(N−1)/N·4Ψ' for fp32
with resharding, 1.5× DDP's all-reduce. Memory per rank: 4Ψ'/N master + 4Ψ'/N gradient + 8Ψ/N
AdamW state, plus, while running, the gathered root and at most two gathered units with their
gradients (and reduce-scatter buffers); through the ring, its 2·N·2^18 elements of shared pages
(4 MB in fp32 at N = 2), and the ring counts one call per round of 2^18 elements of a rank's range.

Several forwards may precede their backwards (a pipeline stage under 1F1B or GPipe): each forward
with grad queues its units, and each backward takes the oldest forward's (backwards must run in
their forwards' order), reducing every micro-batch's gradient into the shards. A pipeline stage's
blocks (an nn.ModuleDict of identical blocks) are its units under `wrap="auto"`; with interleaved
stages each chunk is a wrapper of its own (chunks.py `FullyShardedChunks`). zb's split
backward runs inside `input_pass()` and `weight_pass()` (zero3_split_passes.py): one all-gather
more per unit and micro-batch than a plain backward.

Frozen parameters (requires_grad=False: a LoRA run's base model) are sharded in their unit like the
others, in a flat buffer of their own (zero3_unit.py), all-gathered with it (a second all-gather of
(N−1)/N·F'ᵤ·c bytes, F'ᵤ the unit's padded frozen elements) and never reduced: 4F'/N bytes of master
per rank, no gradient, no optimizer state. A unit holding them is freed once the backward has passed
it (at the next unit's pre-backward hook, or at the end), not when its trainable gradients are in.

Limitations: a parameter must belong to one unit (tied weights inside one unit are fine); a unit's forward runs once per model forward; buffers are neither
sharded nor synchronised; ranks must run the same graph (units finish backward in the same order).
With `param_dtype` ≠ fp32, floating-point inputs of the root forward are cast to it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ndtrain.errors import UserError
from ndtrain.dist.host_stream import SlotRing
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.flat_layout import Segment
from ndtrain.parallel.data.param_groups import GroupFn, group_key, group_keys, one_group
from ndtrain.parallel.data.sync_switch import SyncSwitch
from ndtrain.parallel.data.zero3_split_passes import SplitBackwardPasses
from ndtrain.parallel.data.zero3_unit import FlatUnit
from ndtrain.parallel.data.zero3_wrap import select_units, wrap_patterns
from ndtrain.parallel.grad_norm import Span, flat_pieces, local_squares, segment_spans
from ndtrain.parallel.model.tensor import gather_shard
from ndtrain.parallel.placement import Placement, Shard
from ndtrain.parallel.precision import compute_dtype


def _call(owner: weakref.ref, method: str, *args: Any) -> Any:
    """Call `owner().method(*args)` if the wrapper is still alive (hooks must not keep it alive)."""
    fsdp = owner()
    return None if fsdp is None else getattr(fsdp, method)(*args)


class FullyShardedDataParallel(SplitBackwardPasses, nn.Module):
    """Shard `module` over `ctx.group("dp_cp")` (ZeRO-3); see the module docstring."""

    gradients_sharded = True  # a pipeline runs it outside no_sync: every micro-batch is reduce-scattered

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, *, wrap: Sequence[str] | str = "auto",
        reshard_after_forward: bool = True, param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32, host_slots: bool = False,
    ) -> None:
        """`host_slots`: gather and reduce-scatter through a ring of shared-memory segments where the
        group's ranks share a CPU host (dist/host_stream.py, zero3_unit.py; opening it is collective)."""
        super().__init__()
        self.module, self.ctx = module, ctx
        self.group = ctx.group("dp_cp")
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        patterns = wrap_patterns(module, wrap)
        owner: dict[int, str] = {}
        blocks: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
        for name, sub in select_units(module, patterns) if patterns else []:
            params = [(f"{name}.{n}", p) for n, p in sub.named_parameters() if id(p) not in owner]
            owner.update((id(p), name) for _, p in params)
            if params:
                blocks.append((name, sub, params))
        root_params = [(n, p) for n, p in module.named_parameters() if id(p) not in owner]
        for n, p in module.named_parameters(remove_duplicate=False):
            unit_of = owner.get(id(p))
            if unit_of is not None and not (n == unit_of or n.startswith(unit_of + ".")):
                raise UserError(f"parameter {n} is shared with FSDP unit {unit_of!r}: wrap the modules sharing it in one unit")

        self.ring = _open_ring(module, ctx, param_dtype) if host_slots else None

        def unit(name: str, params: list[tuple[str, nn.Parameter]]) -> FlatUnit:
            return FlatUnit(name, params, self.group, ctx.comm, param_dtype, reduce_dtype, self.ring)

        self.root: FlatUnit | None = unit("", root_params) if root_params else None
        self.blocks = [unit(name, params) for name, _, params in blocks]
        self.units: list[FlatUnit] = ([self.root] if self.root else []) + self.blocks

        ref = weakref.ref(self)
        handles = []
        for block, (_, sub, _) in zip(self.blocks, blocks):
            handles.append(sub.register_forward_pre_hook(functools.partial(_call, ref, "_pre_forward", block)))
            handles.append(sub.register_forward_hook(functools.partial(_call, ref, "_post_forward", block)))
        for u in self.units:
            for i, p in enumerate(u.params):
                hook = functools.partial(_call, ref, "_on_grad", u, i)
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, hook=hook: hook()))
        weakref.finalize(self, lambda: [h.remove() for h in handles])

        self._order: list[FlatUnit] = []  # blocks in forward execution order (recorded once)
        self._order_known = False
        self._sync = SyncSwitch()
        self._callback_queued = False
        self._in_backward: set[int] = set()  # ids of units whose pre-backward ran
        self._forwards: deque[list[FlatUnit]] = deque()  # per forward with grad not yet backward: its units
        self._awaiting: list[FlatUnit] = []  # the running backward's units not yet reduced, in order
        self._reducing: FlatUnit | None = None
        self._peak = 0
        self._split: str | None = None  # "input" / "weight" inside zb's split-backward passes
        self._unit_of = {id(p): u for u in self.units for p in u.params}

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.param_dtype != torch.float32:
            cast = lambda t: t.to(self.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if self.root is not None:
            self.root.wait()
        if self._order_known and self._order:
            self._order[0].gather()
        self._track()
        grad = torch.is_grad_enabled()
        if grad:
            self._forwards.append([self.root] if self.root is not None else [])
        out = self.module(*args, **kwargs)
        self._order_known = True
        if grad and self._register_pre_backward(out, None):
            return out
        if grad:
            self._forwards.pop()
        if self._forwards:  # earlier forwards still wait for their backward
            return out
        if self.root is not None:  # no backward will come: release what the backward would have
            self.root.free()
        for block in self.blocks:
            block.free()
        return out

    def _pre_forward(self, block: FlatUnit, module: nn.Module, args: Any) -> None:
        if not self._order_known and block not in self._order:
            self._order.append(block)
        block.wait()
        if self._order_known:
            i = self._order.index(block)
            if i + 1 < len(self._order):
                self._order[i + 1].gather()
        self._track()

    def _post_forward(self, block: FlatUnit, module: nn.Module, args: Any, out: Any) -> None:
        wants_backward = torch.is_grad_enabled() and self._register_pre_backward(out, block)
        if wants_backward:  # a recomputing forward runs inside the backward it serves
            (self._awaiting if self._callback_queued or not self._forwards else self._forwards[-1]).append(block)
        if self.reshard_after_forward or not wants_backward:
            block.free()

    def _register_pre_backward(self, out: Any, block: FlatUnit | None) -> bool:
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        ref = weakref.ref(self)
        for t in tensors:
            t.register_hook(lambda grad, block=block: _call(ref, "_pre_backward", block))
        return bool(tensors)

    # ----------------------------------------------------------------------------- backward
    def _pre_backward(self, block: FlatUnit | None) -> None:
        """Before the backward of `block` (None: the root, i.e. the start of backward)."""
        if self._split is not None:
            self._split_pre_backward(block)
            return
        key = id(block)
        if key in self._in_backward:
            return
        self._in_backward.add(key)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_call, weakref.ref(self), "_end_backward"))
            self._callback_queued = True
            self._awaiting = self._forwards.popleft() if self._forwards else []  # backwards follow their forwards' order
        unit = self.root if block is None else block
        if unit is not None:
            unit.wait()
            unit.attach_grads()
        if block is not None:
            self._release_passed(block)
        previous = (self._order[-1] if self._order else None) if block is None else self._previous(block)
        if previous is not None and previous in self._awaiting:
            previous.gather()
        self._track()

    def _release_passed(self, block: FlatUnit) -> None:
        """Free the units after `block` in forward order that hold frozen parameters and have nothing left to
        reduce: the backward has reached `block`'s output, so it has passed them (their frozen weights are
        needed until then, after their trainable gradients have arrived)."""
        for later in self._order[self._order.index(block) + 1:]:
            if later.frozen_params and (later not in self._awaiting or not later.params):
                later.free()

    def _previous(self, block: FlatUnit) -> FlatUnit | None:
        i = self._order.index(block)
        return self._order[i - 1] if i > 0 else None

    def _on_grad(self, unit: FlatUnit, index: int) -> None:
        if unit.on_grad(index) and unit in self._awaiting:
            self._post_backward(unit)

    def _post_backward(self, unit: FlatUnit) -> None:
        self._awaiting.remove(unit)
        unit.ready.clear()
        self._track()
        if self._sync.enabled:
            unit.launch_reduce()
            self._track()
            if self._reducing is not None:
                self._reducing.finish_reduce()
            self._reducing = unit
        if not unit.frozen_params:  # else its frozen weights may still be needed: `_release_passed`, `_end_backward`
            unit.free()

    def _end_backward(self) -> None:
        """End of backward: reduce the units whose parameters got no gradient (in reverse forward
        order, the root last), wait for the reduce-scatters, reset the per-backward state."""
        for unit in [u for u in reversed(self._awaiting) if u is not self.root] + [u for u in self._awaiting if u is self.root]:
            unit.attach_grads()
            self._post_backward(unit)
        if self._reducing is not None:
            self._reducing.finish_reduce()
            self._reducing = None
        for unit in self.units:
            unit.ready.clear()
            if unit.frozen_params:
                unit.free()
        self._in_backward.clear()
        self._callback_queued = False

    # ----------------------------------------------------------------------------- public surface
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside keep the full gradients; the next one outside reduce-scatters the sum."""
        return self._sync.off()

    def zero_grad(self, set_to_none: bool = False) -> None:  # type: ignore[override]
        """Zero the shards' gradients (they stay the segments' `.grad`) and drop unreduced full gradients."""
        self._forwards.clear()
        for u in self.units:
            u.shard_grad.zero_()
            u.drop_grads()
            u.attach_segment_grads()

    def parameter_groups(self, group_fn: GroupFn = one_group) -> list[dict[str, Any]]:
        """`[{"params": [segments], **options}]`, one group per distinct `group_fn(name, param)`, in order
        of first appearance in `module.named_parameters()` (the same list on every rank, a group possibly
        without segments here), for `optimizer_fn(groups)`. Call it once: it rebuilds the segments."""
        keys, options = group_keys(self.module, group_fn)
        groups: list[dict[str, Any]] = [{"params": [], **o} for o in options]
        for u in self.units:
            group_of = [keys[group_key(group_fn, n, p)] for n, p in zip(u.names, u.params)]
            for g, segment in u.build_segments(group_of):
                groups[g]["params"].append(segment)
        return groups

    def local_grad_squares(self) -> torch.Tensor:
        """Σ g² over this rank's gradient shards, padding excluded, each parameter weighted by its
        placement (parallel/grad_norm.py; master-dtype scalar: all-reduce it over dp_cp)."""
        spans = unit_norm_spans(self.units, self.ctx.group("tp").size)
        return local_squares(flat_pieces((u.shard_grad for u in self.units), spans), self.units[0].shard.device)

    def segments(self, grad: bool = False) -> list[Segment]:
        """Each parameter piece of this rank's shards, unit by unit: its placement, local shape,
        [start, stop) in the parameter and a view of the master shard (`grad=True`: of `shard_grad`)."""
        return [s for u in self.units for s in u.flat_layout.segments(u.shard_grad if grad else u.shard)]

    def grad_segments(self) -> list[Segment]:
        """`segments(grad=True)`: the pieces of this rank's gradient shards (what a pipeline sums
        for a tied weight, pipeline/tied_shards.py)."""
        return self.segments(grad=True)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: "parameters" (shards, frozen ones included, + gathered units), "gradients"
        (shards + full)."""
        return {"parameters": sum(u.parameter_bytes() for u in self.units),
                "gradients": sum(u.gradient_bytes() for u in self.units)}

    def peak_state_bytes(self, reset: bool = False) -> int:
        """Highest parameters + gradients bytes seen at the hooks since the last reset."""
        peak = self._peak
        if reset:
            self._peak = 0
        return peak

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's fp32 shards (padding included) and the layout they belong to."""
        return {"layout": self._layout(), "shards": {u.name: u.shard.detach() for u in self.units},
                "frozen": {u.name: u.frozen_shard.detach() for u in self.units}}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `sharded_state_dict()` saved by the same group rank of the same layout."""
        saved, mine = state_dict.get("layout"), self._layout()
        if saved != mine:
            raise UserError(
                f"FSDP shards of a different layout (saved world={saved and saved['world']} rank="
                f"{saved and saved['rank']}, here world={mine['world']} rank={mine['rank']}): load them with the "
                "same dp×cp size, model and wrap patterns, or use a full state dict"
            )
        with torch.no_grad():
            for u in self.units:
                u.shard.copy_(state_dict["shards"][u.name])
                u.frozen_shard.copy_(state_dict["frozen"][u.name])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole fp32 model under the original module's state-dict names (collective: every rank
        calls it; one all-gather per unit, and under tp one per tp-sharded parameter, its slices
        gathered over tp with the padding cut away)."""
        where: dict[int, torch.Tensor] = {}
        tp = self.ctx.group("tp")
        for u in self.units:
            for layout, frozen in ((u.flat_layout, False), (u.frozen_layout, True)):
                for p, placement, view in zip(layout.params, layout.placements, layout.views(u.gather_fp32(frozen))):
                    shard = placement.tp if tp.size > 1 else None
                    where[id(p)] = view.clone() if shard is None else gather_shard(
                        view, shard, _real_size(placement, shard), self.ctx.comm, tp)
        return {k: where[id(v)] if id(v) in where else v.detach().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    # ----------------------------------------------------------------------------- internals
    def _layout(self) -> dict[str, Any]:
        return {"world": self.group.size, "rank": self.group.rank, "units": [u.layout() for u in self.units]}

    def _track(self) -> None:
        held = self.state_bytes()
        self._peak = max(self._peak, held["parameters"] + held["gradients"])


def _open_ring(module: nn.Module, ctx: ParallelContext, param_dtype: torch.dtype) -> SlotRing | None:
    """A ring in the units' compute dtype over dp_cp where its ranks share a CPU host (collective;
    None on every rank where some rank cannot map it, or with one rank or no CPU parameters)."""
    group = ctx.group("dp_cp")
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu" or group.size == 1:
        return None
    return SlotRing.open(ctx.comm, group, compute_dtype(param_dtype, first.dtype))


def _real_size(placement: Placement, shard: Shard) -> int:
    """The unsharded size of a tp-sharded parameter along its split dim (its padded size if unnamed)."""
    return placement.shape[shard.dim] if placement.shape is not None else shard.full


def unit_norm_spans(units: Sequence[FlatUnit], tp: int) -> list[list[Span]]:
    """For each unit's shard, where the placement weight of the parameters under it changes, padding
    left out (`grad_norm.segment_spans`); fixed by the layout."""
    return [segment_spans(u.flat_layout.lo, u.flat_layout.hi, u.flat_layout.placed_ranges(), tp) for u in units]
