"""The layout-agnostic checkpoint format: which DCP keys hold what, and the planners that move slices.

Keys (one DCP tensor each, with the unsharded model's global shape, stored as chunks):
    model.<name>                      the parameter (the fp32 master under bf16/fp16 compute)
    optim.state.<name>.<key>          the optimizer's state of it: element-wise state of the parameter's
                                      shape (AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer),
                                      stored in the same boxes, so any layout loads it; scalars (step);
                                      other shapes (Adafactor's factored row_var and col_var) whole, as
                                      one chunk, from and into a rank that holds the whole parameter
`<name>` is `Placement.name`, the parameter's name in the whole model (a tied weight under its
first name). Each rank offers the boxes of its runs (slices.py: what its data-parallel strategy
holds); DCP's deduplication keeps one copy of a box offered by several replicas, so every element
is written once and no tensor is ever gathered; DCP's coordinator checks that the chunks of each
tensor tile it exactly (no gap, no overlap). Loading asks DCP for the boxes this rank holds under
its own layout; DCP reads each from the saved chunks that overlap it. Checkpoint
size: Ψ·(4 + 8) bytes for fp32 AdamW (Ψ·(4 + 4) for SGD with momentum), whatever the layout; each rank writes and reads only its
share (replicas read the same boxes).

`SliceSavePlanner` / `SliceLoadPlanner` are DCP's default planners with the state dict replaced
by explicit (key, offsets, sizes, tensor) pieces; loading keeps `SafePlanner`'s restricted
unpickling. `problems` checks a checkpoint's metadata against what this rank will ask for
(another model's names or shapes, a missing slice) before any rank reads anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ndtrain.checkpoint.slices import boxes, compute_copies, optimizer_state, runs
from ndtrain.errors import UserError
from ndtrain.checkpoint.safe_pickle import SafePlanner

FORMAT = 2  # progress.json "checkpoint_format"; absent: the per-layout format of earlier versions
MODEL = "model."
OPTIM = "optim.state."


@dataclass(frozen=True)
class Piece:
    """One box of one DCP tensor: `key`'s global `size`, the box (`offsets`, `sizes`), the local view."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor


def save_pieces(engine: Any) -> list[Piece]:
    """What this rank writes: the values and optimizer state of every box of the runs it owns."""
    state = optimizer_state(engine)
    pieces = []
    for run in runs(engine):
        if not run.writes:
            continue
        owner_state = state.get(run.owner, {})
        for key, value in owner_state.items():
            if not isinstance(value, torch.Tensor):
                raise UserError(f"optimizer state {key!r} is a {type(value).__name__}: checkpoints hold tensor state "
                                "only (AdamW, Adam, SGD, Adafactor); use one of those optimizers")
            if value.ndim == 0 or value.shape != run.owner.shape:
                pieces.append(_whole(run, f"{OPTIM}{run.name}.{key}", tuple(value.shape), value))
        for box in boxes(run):
            pieces.append(Piece(MODEL + run.name, run.shape, box.offsets, box.sizes, box.view(run.owner)))
            for key, value in owner_state.items():
                if value.ndim > 0 and value.shape == run.owner.shape:
                    pieces.append(Piece(f"{OPTIM}{run.name}.{key}", run.shape, box.offsets, box.sizes, box.view(value)))
    return pieces


def _whole(run: Run, key: str, size: tuple[int, ...], tensor: torch.Tensor) -> Piece:
    """`tensor`, optimizer state not of the parameter's shape (a scalar, a factored moment), as one piece:
    only a rank holding the whole parameter has all of it."""
    if size and (run.tp is not None or run.start != 0 or run.end != run.owner.numel()):
        raise UserError(f"the optimizer state {key[len(OPTIM):]!r} of shape {list(size)} is not element-wise (a factored "
                        "moment such as Adafactor's): it is saved and loaded only where each rank holds whole "
                        "parameters (zero=0, tp=1); use that layout, or an element-wise optimizer (adamw, sgd)")
    return Piece(key, size, (0,) * len(size), size, tensor)


def problems(engine: Any, metadata: Metadata, path: str) -> str | None:
    """What keeps this rank from loading the checkpoint `metadata` describes (None: nothing)."""
    saved = metadata.state_dict_metadata
    fix = "resume with the model that wrote it, or use a fresh --out directory"
    model_keys = {k: v for k, v in saved.items() if k.startswith(MODEL)}
    for run in runs(engine) + compute_copies(engine):
        found = model_keys.get(MODEL + run.name)
        if not isinstance(found, TensorStorageMetadata):
            return f"checkpoint {path!r} holds no parameter {run.name!r}: it was written for another model; {fix}"
        if tuple(found.size) != run.shape:
            return (f"checkpoint {path!r} holds {run.name!r} with shape {list(found.size)}, this model's is "
                    f"{list(run.shape)}: it was written for another model; {fix}")
        state = [v for k, v in saved.items() if k.startswith(f"{OPTIM}{run.name}.") and isinstance(v, TensorStorageMetadata)
                 and tuple(v.size) == run.shape]  # element-wise state; a whole one is read whole (_whole)
        for key, tensor in [(run.name, found)] + [(f"the optimizer state of {run.name}", v) for v in state]:
            missing = sum(_uncovered(tensor, box.offsets, box.sizes) for box in boxes(run))
            if missing:
                return (f"checkpoint {path!r} lacks {missing} of the elements of {key!r} this rank needs "
                        "(a rank's slices are missing): restore the checkpoint from a copy, or resume from another")
    total = sum(math.prod(v.size) for v in model_keys.values() if isinstance(v, TensorStorageMetadata))
    if total != engine.parameter_count:
        return (f"checkpoint {path!r} holds {total} parameter elements, this model {engine.parameter_count}: it was "
                f"written for another model; {fix}")
    return None


def load_pieces(engine: Any, metadata: Metadata) -> list[Piece]:
    """Where this rank's boxes go: values into the owners (and ZeRO-1/2's compute copies), optimizer state
    into the optimizer, allocated as in the checkpoint (state the checkpoint lacks is dropped)."""
    saved = metadata.state_dict_metadata
    keys: dict[str, list[str]] = {}
    for key in saved:
        if key.startswith(OPTIM):
            name, _, item = key[len(OPTIM):].rpartition(".")
            keys.setdefault(name, []).append(item)
    state = optimizer_state(engine)
    pieces = []
    for run in runs(engine):
        owner_state = state[run.owner]
        wanted = keys.get(run.name, [])
        for item in [k for k in owner_state if k not in wanted]:
            del owner_state[item]
        for item in wanted:
            md = saved[f"{OPTIM}{run.name}.{item}"]
            assert isinstance(md, TensorStorageMetadata)
            size = tuple(md.size)
            if item not in owner_state or (size != run.shape and tuple(owner_state[item].shape) != size):
                owner_state[item] = (torch.zeros_like(run.owner, dtype=md.properties.dtype) if size == run.shape
                                     else torch.zeros(size, dtype=md.properties.dtype, device=run.owner.device))
            if size != run.shape:
                pieces.append(_whole(run, f"{OPTIM}{run.name}.{item}", size, owner_state[item]))
        for box in boxes(run):
            pieces.append(Piece(MODEL + run.name, run.shape, box.offsets, box.sizes, box.view(run.owner)))
            for item in wanted:
                if tuple(saved[f"{OPTIM}{run.name}.{item}"].size) == run.shape:
                    view = box.view(owner_state[item])
                    pieces.append(Piece(f"{OPTIM}{run.name}.{item}", run.shape, box.offsets, box.sizes, view))
    for whole in compute_copies(engine):
        for box in boxes(whole):
            pieces.append(Piece(MODEL + whole.name, whole.shape, box.offsets, box.sizes, box.view(whole.owner)))
    return pieces


def _uncovered(saved: TensorStorageMetadata, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Elements of the box (offsets, sizes) no saved chunk holds (saved chunks never overlap)."""
    covered = 0
    for chunk in saved.chunks:
        overlap = 1
        for d in range(len(offsets)):
            lo, hi = max(offsets[d], chunk.offsets[d]), min(offsets[d] + sizes[d], chunk.offsets[d] + chunk.sizes[d])
            overlap *= max(0, hi - lo)
        covered += overlap
    return math.prod(sizes) - covered


class SliceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner writing explicit pieces (the state dict passed to `dcp.save` is ignored)."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__()
        self.pieces = {(p.key, p.offsets): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(p.key, torch.Size(p.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)),
                    properties=TensorProperties(dtype=p.tensor.dtype),
                    size=torch.Size(p.size),
                ),
            )
            for p in self.pieces.values()
        ]
        self.plan = SavePlan(items, planner_data={})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        piece = self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]
        return piece.tensor.detach().contiguous()


class SliceLoadPlanner(SafePlanner):
    """`SafePlanner` reading explicit pieces (each copied into its local view) instead of a state dict."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__()
        self.by_key: dict[str, list[Piece]] = {}
        for p in pieces:
            self.by_key.setdefault(p.key, []).append(p)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, pieces in self.by_key.items():
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata)
            chunks = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in pieces]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.by_key[read_item.dest_index.fqn][read_item.dest_index.index].tensor
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # `tensor` is the piece's view: DCP copied into it

