"""One FSDP wrapping unit: its parameters in one flat buffer, sharded over the data-parallel ranks.

The unit's parameters (Ψᵤ elements, in registration order) are laid end to end in a flat fp32
buffer, zero-padded to Ψᵤ' = s·N (s = ⌈Ψᵤ/N⌉, N ranks; `flat_layout`, the padded flat layout ZeRO-1
and ZeRO-2 use too: flat_layout.py). Group rank r keeps the slice
[r·s, (r+1)·s) as `shard` (the fp32 master) and `shard_grad` (its fp32 gradient); that is all a
unit holds between steps. The module's own parameters stay in place, but their `.data` are views
of `full`, a Ψᵤ'-element buffer in the compute dtype whose storage exists only while gathered:

- `gather()` allocates `full`'s storage and all-gathers the shards (cast to the compute dtype)
  into it, asynchronously; `wait()` completes it. `free()` releases the storage (the views keep
  their shapes, so autograd's saved references see the data again after the next gather).
- `attach_grads()` gives every parameter a `.grad` that is a view of `grad_full` (compute dtype,
  zeros), so autograd accumulates into one flat buffer; `launch_reduce()` reduce-scatters it (in
  the reduction dtype, summed) and drops it; `finish_reduce()` waits and adds sum / N into
  `shard_grad`.
- `build_segments()` cuts the real elements of the shard (padding excluded) where the parameter
  group changes and every `OPTIMIZER_RUN` elements (flat_layout.py): `nn.Parameter`s aliasing
  `shard`, with `.grad` aliasing `shard_grad`, which is what the optimizer updates in place;
  `held_slices()` maps them back to parameter pieces for checkpoints (held_slices.py).

A float64 model keeps float64 masters, gradients and compute (`master_dtype`): "fp32" below means
the master dtype; only a 16-bit `param_dtype` is mixed precision.

Frozen parameters (requires_grad=False: a LoRA run's base) lie in a second flat layout of their own,
`frozen_shard` / `frozen_full`, gathered and freed with the unit's: sharded like the rest, but with no
gradient, no reduce-scatter and no optimizer segment. A unit may hold only frozen parameters (a
layer without adapters) or only trainable ones; an empty layout issues no collective.

On one CPU host (`FullyShardedDataParallel(host_slots=True)`, the engine's default there) the
gathers and reduce-scatters go through the wrapper's `SlotRing` (dist/host_stream.py: a few MB of
shared-memory segments taken in turn by rounds of 2^18 elements of every rank's range) instead of
gloo's loopback sockets, wherever the ring carries the operation's dtype (the compute dtype for a
gather, the reduction dtype for a reduce-scatter): `gather()` casts the shard into its range of
`full` and streams the others' ranges in; `launch_reduce()` streams `grad_full` out and its range's
mean in. The bytes moved and counted are the same ((N−1)/N of the buffer each, as
`all_gather_shm` / `reduce_scatter_shm`); the summation order differs from gloo's.

Per unit and rank: 4s bytes of master + 4s of gradient (+ AdamW's 8 per real element); while
gathered, Ψᵤ'·c bytes of parameters (c = compute itemsize), and during its backward Ψᵤ'·c of
gradient (+ Ψᵤ'·4 for the cast when the reduction dtype differs). Communication: each gather
(N−1)/N·Ψᵤ'·c bytes, each reduce-scatter (N−1)/N·Ψᵤ'·r bytes (r = reduction itemsize).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group, Pending
from ndtrain.dist.host_stream import SlotRing
from ndtrain.dist.memory import tensor_bytes
from ndtrain.parallel.data.flat_layout import OPTIMIZER_RUN, FlatLayout
from ndtrain.parallel.data.held_slices import HeldSlice, flat_slices
from ndtrain.parallel.precision import compute_dtype, master_dtype, reduction_dtype


class FlatUnit:
    """The flat buffers of one wrapping unit (`name` is the module name, "" for the root)."""

    def __init__(
        self, name: str, params: list[tuple[str, nn.Parameter]], group: Group, comm: Communicator,
        param_dtype: torch.dtype, reduce_dtype: torch.dtype, ring: SlotRing | None = None,
    ) -> None:
        """`ring`: the wrapper's shared-memory ring (one CPU host), used for the operations whose dtype it carries."""
        self.name, self.group, self.comm = name, group, comm
        self.names = [n for n, p in params if p.requires_grad]
        self.params = [p for _, p in params if p.requires_grad]
        self.frozen_names = [n for n, p in params if not p.requires_grad]
        self.frozen_params = [p for _, p in params if not p.requires_grad]
        first = params[0][1]
        self.master_dtype = master_dtype(first.dtype)
        self.param_dtype = compute_dtype(param_dtype, first.dtype)
        self.reduce_dtype = reduction_dtype(reduce_dtype, self.param_dtype)
        self._gather_ring = ring if ring is not None and ring.dtype == self.param_dtype else None
        self._reduce_ring = ring if ring is not None and ring.dtype == self.reduce_dtype else None
        layout = self.flat_layout = FlatLayout(self.params, group.size, group.rank)
        self.frozen_layout = FlatLayout(self.frozen_params, group.size, group.rank)
        self.numel, self.size, self.padded = layout.numel, layout.size, layout.padded
        self.shard, self.full = self._flatten(layout, first.device)
        self.frozen_shard, self.frozen_full = self._flatten(self.frozen_layout, first.device)
        self.shard_grad = torch.zeros_like(self.shard)
        self._storage_bytes = tensor_bytes(self.full) + tensor_bytes(self.frozen_full)
        for full in (self.full, self.frozen_full):
            full.untyped_storage().resize_(0)
        self.gathered = False
        self._pending: list[Pending] = []
        self._send: list[torch.Tensor] = []
        self.grad_full: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._reduce: tuple[Pending, torch.Tensor, torch.Tensor] | None = None
        self.segments: list[tuple[int, int, nn.Parameter]] = []  # (start, end) in the shard, parameter
        self.ready: set[int] = set()  # parameters whose gradient arrived in this backward

    def _flatten(self, layout: FlatLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's master shard, the compute-dtype buffer the parameters of `layout` become views of),
        from group rank 0's weights (one broadcast, none for an empty layout)."""
        flat = torch.zeros(layout.padded, dtype=self.master_dtype, device=device)
        with torch.no_grad():
            for p, view in zip(layout.params, layout.views(flat)):
                view.copy_(p.detach())
        if layout.padded:
            self.comm.broadcast(flat, self.group, src=0)  # every rank starts from group rank 0's weights
        full = torch.empty(layout.padded, dtype=self.param_dtype, device=device)
        for p, view in zip(layout.params, layout.views(full)):
            p.data = view
        return flat[layout.lo : layout.hi].clone(), full

    # ----------------------------------------------------------------------------- parameters
    @property
    def busy(self) -> bool:
        """Gathered or being gathered."""
        return self.gathered or bool(self._pending)

    def gather(self) -> None:
        """Launch the all-gathers of the full parameters, trainable and frozen (no-op if gathered or in flight)."""
        if self.busy:
            return
        for full, shard, layout in ((self.full, self.shard, self.flat_layout),
                                    (self.frozen_full, self.frozen_shard, self.frozen_layout)):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if not layout.padded:
                continue
            if self._gather_ring is not None:
                full[layout.lo : layout.hi].copy_(shard)  # casts to the compute dtype
                self._pending.append(self._gather_ring.all_gather(full, layout.size))  # type: ignore[arg-type]
                continue
            send = shard if self.param_dtype == self.master_dtype else shard.to(self.param_dtype)
            self._send.append(send)
            self._pending.append(self.comm.all_gather(full, send, self.group, async_op=True))
        self.gathered = not self._pending

    def wait(self) -> None:
        """Make sure the full parameters are present (gathering them now if nobody prefetched)."""
        self.gather()
        if self._pending:
            for pending in self._pending:
                pending.wait()
            self._pending, self._send = [], []
            self.gathered = True

    def free(self) -> None:
        """Release the full parameters' storage (after completing a gather still in flight)."""
        if self._pending:
            self.wait()
        if self.gathered:
            for full in (self.full, self.frozen_full):
                full.untyped_storage().resize_(0)
            self.gathered = False

    # ----------------------------------------------------------------------------- gradients
    def attach_grads(self) -> None:
        """Point every parameter's `.grad` at its view of `grad_full` (allocated as zeros if absent)."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.padded, dtype=self.param_dtype, device=self.shard.device)
            self._grad_views = self.flat_layout.views(self.grad_full)
        for p, view in zip(self.params, self._grad_views):
            if p.grad is not view:
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = view

    def on_grad(self, index: int) -> bool:
        """A parameter's gradient has been accumulated; True when the whole unit's has."""
        p = self.params[index]
        if self.grad_full is None or p.grad is not self._grad_views[index]:
            self.attach_grads()  # a gradient autograd allocated on its own: fold it into the flat buffer
        self.ready.add(index)
        return len(self.ready) == len(self.params)

    def launch_reduce(self) -> None:
        """Reduce-scatter the full gradient (summed over ranks; through the ring: averaged) and release
        it and the `.grad` views (nothing to reduce without trainable parameters)."""
        if not self.padded:
            self.drop_grads()
            return
        self.attach_grads()
        assert self.grad_full is not None and self._reduce is None
        full = self.grad_full if self.reduce_dtype == self.param_dtype else self.grad_full.to(self.reduce_dtype)
        out = torch.empty(self.size, dtype=self.reduce_dtype, device=full.device)
        if self._reduce_ring is not None:
            def read(offset: int, into: torch.Tensor) -> None:
                into.copy_(full[offset : offset + into.numel()])

            pending: Pending | None = self._reduce_ring.reduce_scatter_mean(read, out, self.size)  # type: ignore[assignment]
        else:
            pending = self.comm.reduce_scatter(out, full, self.group, async_op=True)
        assert pending is not None
        self._reduce = (pending, out, full)
        self.drop_grads()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and add its mean into `shard_grad` (restarting from zero if
        the optimizer dropped the segments' `.grad`s with `zero_grad(set_to_none=True)`)."""
        if self._reduce is None:
            return
        pending, out, _ = self._reduce
        pending.wait()
        self._reduce = None
        with torch.no_grad():
            if any(seg.grad is None for _, _, seg in self.segments):
                self.shard_grad.zero_()
            mean = out.to(self.master_dtype)
            self.shard_grad.add_(mean if self._reduce_ring is not None else mean.div_(self.group.size))
        self.attach_segment_grads()

    def drop_grads(self) -> None:
        self.grad_full, self._grad_views = None, []
        for p in self.params:
            p.grad = None

    def attach_segment_grads(self) -> None:
        for a, b, seg in self.segments:
            seg.grad = self.shard_grad[a:b]

    @property
    def real(self) -> int:
        """Elements of this rank's shard that are parameters (the rest is padding)."""
        return self.flat_layout.real

    # ----------------------------------------------------------------------------- optimizer view
    def build_segments(self, group_of: list[int]) -> list[tuple[int, nn.Parameter]]:
        """Cut the shard's real elements into parameters, one per run of the same group index
        (`group_of[i]` for parameter i); return (group index, segment) pairs in shard order."""
        lo = self.flat_layout.lo
        runs = [(a - lo, b - lo, g) for a, b, g in self.flat_layout.runs(group_of, OPTIMIZER_RUN)]  # in shard coordinates
        self.segments = [(a, b, nn.Parameter(self.shard[a:b])) for a, b, _ in runs]
        self.attach_segment_grads()
        return [(g, seg) for (_, _, g), (_, _, seg) in zip(runs, self.segments)]

    def held_slices(self) -> list[HeldSlice]:
        """The parameter pieces the segments hold (for checkpoints; their [a, b) is in shard coordinates),
        then the frozen pieces, held in `frozen_shard`."""
        lo = self.flat_layout.lo
        frozen = self.frozen_layout
        return (flat_slices(self.flat_layout, [(lo + a, lo + b, segment) for a, b, segment in self.segments])
                + flat_slices(frozen, [(frozen.lo, frozen.hi, self.frozen_shard)]))

    # ----------------------------------------------------------------------------- accounting
    def parameter_bytes(self) -> int:
        return tensor_bytes(self.shard) + tensor_bytes(self.frozen_shard) + (self._storage_bytes if self.busy else 0)

    def gradient_bytes(self) -> int:
        held = tensor_bytes(self.shard_grad) + (tensor_bytes(self.grad_full) if self.grad_full is not None else 0)
        if self._reduce is not None:
            _, out, full = self._reduce
            held += tensor_bytes(out) + tensor_bytes(full)
        return held

    def layout(self) -> dict[str, Any]:
        return {"name": self.name, "numel": self.numel, "size": self.size, "names": list(self.names),
                "frozen": list(self.frozen_names)}

    def gather_fp32(self, frozen: bool = False) -> torch.Tensor:
        """The full master-dtype (fp32, or float64) parameters, trainable or `frozen` (a new buffer; one
        all-gather, none for an empty layout), for state dicts."""
        layout, shard = (self.frozen_layout, self.frozen_shard) if frozen else (self.flat_layout, self.shard)
        flat = torch.empty(layout.padded, dtype=self.master_dtype, device=shard.device)
        if layout.padded:
            self.comm.all_gather(flat, shard, self.group)
        return flat
