"""ZeRO stage 1: the optimizer state is sharded over the data-parallel ranks; parameters and gradients are not.

What is split: the optimizer's work and state. `Zero1DataParallel` (zero1_gradients.py: DDP whose
buckets are reduce-scattered) has packed the trainable parameters into buckets, each a flat gradient
buffer padded with zeros to a multiple of N (the size of `ctx.group("dp_cp")`); here every bucket
also gets a flat *parameter* buffer with the same layout, and the module's parameters become views
into it (`param.data = flat[a:b].view_as(param)`). Group rank r owns the contiguous slice
[r·s, (r+1)·s) of every bucket, s = padded size / N. The real elements of that slice (padding
excluded) are cut where the parameter group changes (e.g. weight decay on matrices, none on biases
and norms) and every `OPTIMIZER_RUN` (2^20) elements (flat_layout.py) into *segments*:
parameters that alias the flat buffer, whose `.grad` aliases the gradient bucket's slice. The
inner optimizer (built by the caller's factory) sees only these segments, so its state exists
only for this rank's slice, and its in-place update writes straight into the model's parameters.
The segment is the fp32 (or fp64) master: no copy. The padded layout is `FlatLayout`
(flat_layout.py, shared with the gradient buckets and ZeRO-3's units); `segments()` maps this
rank's slice back to parameter pieces and their placements. (Over a plain
`DistributedDataParallel`, whose all-reduce leaves the whole gradient averaged, it works the same.)

What is communicated, and when:
- During the synchronising backward, each gradient bucket is reduce-scattered in place as soon as
  it is complete (zero1_gradients.py): this rank's slice holds the averaged gradient when backward
  returns; micro-batches under `no_sync` accumulate locally in the full gradients. (On one CPU
  host the slice is the bucket's separate `shard`, dropped with the `.grad`s by
  `zero_grad(set_to_none=True)`: each step's segments read their gradient in `prepare_grads()`.)
- In `step()`, after the inner optimizer has updated this rank's slices, every bucket's slices
  are gathered in place into its flat buffer: all launched asynchronously, in bucket order, then
  waited for. Every rank ends with the same parameters. NCCL: one all-gather per bucket
  (`ctx.comm.all_gather(flat, flat[r·s:(r+1)·s])`); a gradient bucket on one CPU host
  (zero1_gradients.py): through its shared-memory ring (`SlotRing.all_gather`, dist/host_stream.py),
  (N−1)/N·4Ψ' read between the processes, counted exactly; other gloo groups: N broadcasts per
  bucket, each slice from its owner, because gloo's all-gather stages its output in a temporary copy of the whole bucket
  (4Ψ' of extra peak memory with every bucket in flight; the volume on the wire is the same).
- `clip_grad_norm_`: the squares of this rank's gradient slices, one 4-byte all-reduce over dp_cp
  (summed over mp too under tensor or pipeline parallelism, `grad_norm.global_grad_norm`).

Cost, with Ψ trainable elements (fp32), Ψ' ≥ Ψ padded (Ψ' − Ψ < N per bucket), N ranks, ring
algorithms: memory per rank 4Ψ' parameters + 4Ψ' gradients + 8Ψ/N AdamW state (exp_avg and
exp_avg_sq of the real elements of the slice; plus one 4-byte step counter per segment), instead
of 4Ψ + 4Ψ + 8Ψ for DDP; on one CPU host the gradients (4Ψ + the 4Ψ'/N shard) exist only from
backward to the next `zero_grad(set_to_none=True)`. Each rank sends per step (N−1)/N · 4Ψ' bytes
of reduce-scatter + (N−1)/N · 4Ψ' of all-gather: 2(N−1)/N · 4Ψ', DDP's volume. (On gloo, whose reduce-scatter is an
all-reduce of a copy, the reduce-scatter really sends 2(N−1)/N · 4Ψ'; `ctx.comm` counts textbook
volumes, and counts a broadcast once, at its root: (N−1)/N·4Ψ' of gather only for N = 2.)

The same class serves ZeRO-2 (zero2_gradients.py: the gradient slices are then this rank's reduce-scattered
gradient shard, `model.gradients_sharded`) and mixed precision: when the model's parameters are
bf16/fp16 compute copies, each segment is instead an fp32 *master* copy of the slice (+4Ψ/N bytes),
its gradient an fp32 cast of the gradient slice made in `prepare_grads()`, and after the inner step
the master slice is cast into the flat buffer before the all-gather (which then moves 2-byte
elements). With `sharded=False` (plain DDP + mixed precision) N is taken as 1: every rank keeps the
whole master copy and nothing is gathered. The engine drives it through `ZeroStrategy`
(zero_strategy.py: ZeRO-0 masters, 1, 2); checkpoints read this rank's segments as parameter pieces
(`held_slices()`), whatever the layout.

Limitations: a parameter that no rank used (DDP `allow_unused`, `.grad` None) still gets weight
decay here (its gradient slice is zero), where a single-process optimizer would skip it. The
flat buffers must keep backing the parameters: do not move the model (`.to()`) or reassign
`param.data` after construction. `state_dict()` is per rank and only loads into the same layout
(the engine's checkpoints are layout-agnostic: checkpoint/slices.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import torch
from torch import nn

from ndtrain.dist.comm import Pending
from ndtrain.errors import UserError
from ndtrain.dist.host_stream import SlotRing
from ndtrain.dist.memory import optimizer_state_bytes, tensor_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.flat_layout import OPTIMIZER_RUN, FlatLayout, Segment
from ndtrain.parallel.data.held_slices import HeldSlice, flat_slices
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn, group_key, group_keys, one_group
from ndtrain.parallel.data.zero1_gradients import HostShardReduceBucket, ShardReduceBucket
from ndtrain.parallel.grad_norm import GradPiece, Span, clip_, flat_pieces, global_grad_norm, segment_pieces, segment_spans

class GradientSource(Protocol):
    """What ZeroOptimizer needs of the gradient side: DistributedDataParallel (replicated) or Zero2DataParallel (sharded)."""

    module: nn.Module
    gradients_sharded: bool

    @property
    def buckets(self) -> tuple[Any, ...]: ...  # each with `.params`, in bucket order

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor: ...

    def zero_grad(self, set_to_none: bool = False) -> None: ...


class _Shard:
    """One bucket's flat parameter buffer (its `flat_layout` over N ranks), this rank's [lo, hi) of it,
    its fp32 master (if separate) and the shared-memory ring its gradient bucket reduces through."""

    def __init__(self, index: int, layout: FlatLayout, flat: torch.Tensor, master: torch.Tensor | None,
                 ring: SlotRing | None) -> None:
        self.index, self.flat_layout, self.flat, self.master, self.ring = index, layout, flat, master, ring
        self.lo, self.hi = layout.lo, layout.hi
        self.segments: list[tuple[int, int, int, nn.Parameter]] = []  # (a, b, group, param)


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard the optimizer of a `DistributedDataParallel` model over `ctx.group("dp_cp")` (ZeRO stage 1).

    `optimizer_fn(groups)` receives a list of parameter groups, `{"params": [segments], **options}`,
    one per distinct `group_fn(name, param)` result (a dict of hashable option values, e.g.
    `no_decay_for_vectors`; default: one group), in order of first appearance in
    `module.named_parameters()`: the same list on every rank, though a group may hold no segment
    on some ranks. It must return an optimizer over exactly those groups, e.g.
    `lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)` (options given in a group
    override the constructor's). The optimizer must be elementwise (SGD, Adam, AdamW...): one
    that looks across a whole tensor (Adafactor, LAMB, Shampoo) would see segments instead.

    It is a `torch.optim.Optimizer` only so that LR schedulers accept it: `param_groups`, `state`
    and `defaults` are the inner optimizer's, and Optimizer's step hooks are not supported.
    """

    def __init__(
        self, model: GradientSource, ctx: ParallelContext, optimizer_fn: OptimizerFn, *,
        group_fn: GroupFn = one_group, masters: dict[int, torch.Tensor] | None = None, sharded: bool = True,
    ) -> None:
        """`masters` maps `id(param)` to its fp32 initial value when the parameters are low-precision
        compute copies (default: their upcast); `sharded=False` keeps the whole state on every rank."""
        # Optimizer.__init__ is not called: the parameters belong to the inner optimizer.
        if not hasattr(model, "gradient_slice"):
            raise UserError(f"ZeroOptimizer needs a DistributedDataParallel-wrapped model, got {type(model).__name__}: wrap it first")
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self.model, self.ctx = model, ctx
        self.group = ctx.group("dp_cp")
        self.sharded = sharded
        n, rank = (self.group.size, self.group.rank) if sharded else (1, 0)
        self._gather = n > 1
        self._prepared = False
        # Only this rank's range of the gradient is averaged (ZeRO-2 shards, ZeRO-1's reduce-scattered buckets)
        self._grads_in_shard = model.gradients_sharded or any(
            isinstance(b, (ShardReduceBucket, HostShardReduceBucket)) for b in model.buckets)
        names = {id(p): name for name, p in model.module.named_parameters()}
        keys, options = group_keys(model.module, group_fn)
        segments: list[list[nn.Parameter]] = [[] for _ in options]
        self._shards: list[_Shard] = []
        for k, bucket in enumerate(model.buckets):
            first = bucket.params[0]
            layout = FlatLayout(bucket.params, n, rank)
            flat = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
            low_precision = torch.finfo(first.dtype).bits < 32  # bf16/fp16 compute copies; fp64 is its own master
            master = torch.zeros(layout.size, dtype=torch.float32, device=first.device) if low_precision else None
            shard = _Shard(k, layout, flat, master, bucket.ring if isinstance(bucket, HostShardReduceBucket) and n > 1 else None)
            with torch.no_grad():
                for p, view in zip(bucket.params, layout.views(flat)):
                    view.copy_(p.detach())
                    p.data = view
                if master is not None:
                    for piece in layout.segments(master):
                        p = layout.params[piece.index]
                        source = (masters or {}).get(id(p), p.detach()).reshape(-1)
                        piece.flat_view.copy_(source[piece.start : piece.stop])
            group_of = [keys[group_key(group_fn, names[id(p)], p)] for p in bucket.params]
            for a, b, g in layout.runs(group_of, OPTIMIZER_RUN):
                # the fp32 master: the flat buffer itself, or this rank's separate fp32 copy
                segment = nn.Parameter(flat[a:b] if master is None else master[a - shard.lo : b - shard.lo])
                shard.segments.append((a, b, g, segment))  # its .grad: the gradient slice, at prepare_grads()
                segments[g].append(segment)
            self._shards.append(shard)

        groups = [{"params": list(s), **o} for s, o in zip(segments, options)]
        optimizer = optimizer_fn(groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        got = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        if got != [[id(p) for p in s] for s in segments]:
            raise UserError(
                "the optimizer factory must build its optimizer from exactly the parameter groups it is "
                f"given (ZeRO shards: {[len(s) for s in segments]} tensors per group), but it holds "
                f"{[len(g) for g in got]}: pass the factory's argument to the optimizer, e.g. "
                "lambda groups: torch.optim.AdamW(groups, lr=...)"
            )
        self.optimizer = optimizer

    # ----------------------------------------------------------------------------- Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Update this rank's slices, then all-gather every bucket so all ranks hold the new parameters."""
        if closure is not None:
            raise UserError("ZeroOptimizer.step takes no closure: run forward and backward before calling it")
        if not self._prepared:
            self.prepare_grads()
        self.optimizer.step()
        self._prepared = False
        for shard in self._shards:
            for *_, segment in shard.segments:
                segment.grad = None  # a view of the gradient (or its fp32 cast), fetched again next step
            if shard.master is not None:
                shard.flat[shard.lo : shard.lo + shard.master.numel()].copy_(shard.master)
        if not self._gather:
            return
        pending = [p for s in self._shards for p in self._launch_gather(s)]
        for p in pending:
            assert p is not None
            p.wait()

    def _launch_gather(self, shard: _Shard) -> list[Pending | None]:
        """Start gathering every rank's updated range of `shard.flat` into it, in place. gloo's
        all-gather stages its whole output in a temporary copy (4Ψ' more at once with every bucket
        in flight), so on gloo each rank's range is broadcast from its owner instead, as torch's
        ZeroRedundancyOptimizer does: the same bytes on the wire, no copy."""
        if shard.ring is not None:  # the gradient bucket's shared-memory ring (zero1_gradients.py)
            return [shard.ring.all_gather(shard.flat, shard.flat_layout.size)]
        if self.ctx.backend != "gloo":
            return [self.ctx.comm.all_gather(shard.flat, shard.flat[shard.lo : shard.hi], self.group, async_op=True)]
        size = shard.flat_layout.size
        return [self.ctx.comm.broadcast(shard.flat[r * size : (r + 1) * size], self.group, src=r, async_op=True)
                for r in range(self.group.size)]

    @torch.no_grad()
    def prepare_grads(self) -> list[torch.Tensor]:
        """Attach to every segment the gradient the inner optimizer will use and return them: views of
        the gradient slices, or fp32 casts of them under mixed precision (made once per step: until
        `step()` or `zero_grad()`, later calls return the same tensors). Unscaling or clipping these
        tensors in place is what `step()` then applies."""
        grads = []
        if self._prepared:
            return [seg.grad for s in self._shards for *_, seg in s.segments]
        for shard in self._shards:
            for a, b, _, segment in shard.segments:
                grad = self.model.gradient_slice(shard.index, a, b)
                segment.grad = grad if shard.master is None else grad.float()
                grads.append(segment.grad)
        self._prepared = True
        return grads

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buckets or shards in place (`set_to_none` drops DDP's `.grad`s; the buckets
        stay, but ZeRO-1's on one host hold nothing until the next backward) and forget this step's
        prepared gradients."""
        self._prepared = False
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient so its 2-norm is at most `max_norm`, like `torch.nn.utils.clip_grad_norm_`.

        Call after backward, before `step()`. Replicated gradients (DDP): the local norm is the global one and nothing is communicated. Averaged only in
        this rank's range (ZeRO-1's reduce-scattered buckets, ZeRO-2's shards): the squares of this
        rank's segments (padding excluded) are summed with one 4-byte all-reduce over dp_cp. Each
        parameter's squares are weighted by its placement and summed over mp too under model
        parallelism (`grad_norm.global_grad_norm`). Returns the norm before clipping.
        """
        grads = self.prepare_grads()
        tp = self.ctx.group("tp").size
        if self._grads_in_shard:
            pieces = self.norm_pieces(grads, self.norm_spans(tp))
        else:
            pieces = [piece for b in self.model.buckets
                      for piece in segment_pieces(b.flat, segment_spans(0, b.flat.numel(), b.flat_layout.placed_ranges(), tp))]
        norm = global_grad_norm(pieces, self.ctx, sharded=self._grads_in_shard)
        clip_(grads, norm, max_norm)
        return norm

    # ----------------------------------------------------------------------------- inspection, state
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (every tensor in the inner optimizer's state)."""
        return optimizer_state_bytes(self.optimizer)

    @property
    def shard_numel(self) -> int:
        """Real (unpadded) elements this rank updates."""
        return sum(b - a for s in self._shards for a, b, *_ in s.segments)

    @property
    def padded_numel(self) -> int:
        """Ψ': elements of all flat parameter buffers, padding included (what the all-gathers move)."""
        return sum(s.flat.numel() for s in self._shards)

    @property
    def master_bytes(self) -> int:
        """Bytes of separate fp32 master slices (0 when the parameters themselves are fp32 or fp64)."""
        return sum(s.master.numel() * 4 for s in self._shards if s.master is not None)

    def parameter_bytes(self) -> int:
        """Bytes of the flat parameter buffers (the module's parameters are views of them)."""
        return sum(tensor_bytes(s.flat) for s in self._shards)

    def norm_spans(self, tp: int) -> list[list[Span]]:
        """For each segment (in `prepare_grads()` order), where the placement weight of the parameters
        under it changes (`grad_norm.segment_spans`); fixed by the layout."""
        return [segment_spans(a, b, shard.flat_layout.placed_ranges(), tp)
                for shard in self._shards for a, b, *_ in shard.segments]

    def norm_pieces(self, grads: list[torch.Tensor], spans: list[list[Span]]) -> list[GradPiece]:
        """The norm's pieces of this rank's segments; on a rank whose slices are all padding, one empty
        piece of the gradients' dtype, so that its Σg² is summed over dp_cp in the others' dtype (a
        float32 zero against their float64 would be a mismatched all-reduce)."""
        pieces = flat_pieces(grads, spans)
        if pieces or not self._shards:
            return pieces
        lo = self._shards[0].lo
        empty = self.model.gradient_slice(0, lo, lo)
        return [(empty if self._shards[0].master is None else empty.float(), 1.0)]

    def held_slices(self) -> list[HeldSlice]:
        """The parameter pieces this rank's segments hold, bucket by bucket (for checkpoints; a
        segment's [a, b) is in its bucket's flat coordinates)."""
        return [h for s in self._shards for h in flat_slices(s.flat_layout, [(a, b, seg) for a, b, _, seg in s.segments])]

    def segments(self, grad: bool = False) -> list[Segment]:
        """Each parameter piece this rank updates, bucket by bucket: its placement, local shape,
        [start, stop) in the parameter and a view of this rank's master values (the fp32 master, or
        the flat buffer's range when the parameters are fp32/fp64), or with `grad=True` of the
        gradient slice the optimizer reads (before any fp32 cast)."""
        out = []
        for k, s in enumerate(self._shards):
            values = s.master if s.master is not None else s.flat[s.lo : s.hi]
            out += s.flat_layout.segments(self.model.gradient_slice(k, s.lo, s.hi) if grad else values)
        return out

    def _layout(self) -> dict[str, Any]:
        return {"world": self.group.size, "rank": self.group.rank,
                "segments": [[(a, b, g) for a, b, g, *_ in s.segments] for s in self._shards]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the inner optimizer's state dict and the layout it belongs to.

        Parameters are not included (they are replicated: save the model's state dict once).
        """
        return {"optimizer": self.optimizer.state_dict(), "layout": self._layout(),
                "masters": [s.master.clone() for s in self._shards if s.master is not None]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()` saved by the same group rank of the same layout (same N, buckets, groups)."""
        saved, mine = state_dict.get("layout"), self._layout()
        if saved != mine:
            what = "rank/world" if saved and (saved["world"], saved["rank"]) != (mine["world"], mine["rank"]) else "shard layout"
            raise UserError(
                f"ZeRO optimizer state of a different {what} (saved world={saved and saved['world']} "
                f"rank={saved and saved['rank']}, here world={mine['world']} rank={mine['rank']}): load it with "
                "the same dp×cp size, bucket_mb and parameter groups"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for shard, master in zip([s for s in self._shards if s.master is not None], state_dict.get("masters", [])):
                shard.master.copy_(master)
