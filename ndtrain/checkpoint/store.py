"""Checkpoints with `torch.distributed.checkpoint` (DCP): layout-agnostic, atomic, verified.

Layout of RUN_DIR/checkpoints:
    step_00000050/          one DCP checkpoint of model and optimizer state (`format.py`)
        .metadata, *.distcp every tensor under the unsharded model's names with global shapes
        progress.json       trainer progress, LR schedule, optimizer hyperparameters (JSON, rank 0)
        rng/rank00000.pt    each rank's RNG states (written by that rank only)
        buffers/rank*.pt    persistent buffers (BatchNorm statistics) by name, one file per stage (`buffers.py`)
        manifest.json       every file's size and SHA-256, step, layout, versions (written last)
    latest                  name of the newest complete checkpoint

A checkpoint is written into `step_XXXXXXXX.partial`; after every rank has finished, rank 0
writes the manifest (`manifest.py`), renames the directory and replaces `latest`
(os.replace), so a crash mid-save never damages the previous checkpoint. A save the file system
refuses (no space, no permission) ends the run on every rank with one line naming the file
system, the space the save needs and the newest verified checkpoint left, the `.partial` save
removed (`save_agreement.settle`; the rule is ndtrain/failures.py's). Resuming uses the
newest checkpoint that verifies against its manifest, naming each damaged one; rotation keeps the
newest `keep` verified checkpoints. Each rank writes only the slices of parameters and optimizer
state it owns and reads only the slices it holds (`slices.py`), so a checkpoint written
under one layout (dp × cp × pp × tp, ZeRO 0–3, precision) loads under any other; nothing is
gathered. Cost on disk: Ψ·(4 + 8) bytes for fp32 AdamW (fp32 masters under bf16/fp16).
Nothing is unpickled with arbitrary classes (`safe_pickle`). Checkpoints of the earlier
per-layout format (no "checkpoint_format" in progress.json) are refused in one line; their
weights still load with `load_model_weights` (generate, export, model.init_from).

DCP itself (and the modules built on it: `format`, `safe_pickle`, `save_agreement`) is imported by
the functions that save and load, not with this module: its import costs about 1 s (DTensor, sympy),
paid by every process of a run otherwise, and by none that never saves or resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.checkpoint.buffers import buffer_names, held, load_buffers, write_buffers
from ndtrain.checkpoint.manifest import PARTIAL, Choice, choose, obsolete, step_of, write_manifest
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext

LATEST = "latest"
PROGRESS = "progress.json"
_NONE, _FAILED = -1, -2  # broadcast codes of `select_checkpoint` besides a step number


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def newest_verified(directory: Path) -> Path | None:
    """The newest checkpoint of `directory` that verifies (one process: generate, export).

    Each damaged newer one is named on stderr; step directories none of which verifies are a
    UserError, so a damaged run is never mistaken for one without checkpoints.
    """
    choice = choose(directory)
    _report(choice, directory)
    if choice.path is None and choice.candidates:
        raise UserError(_none_verified(choice, directory, "restore one of them from a copy"))
    return choice.path


def select_checkpoint(directory: Path, ctx: ParallelContext, start_over: bool) -> Path | None:
    """The checkpoint every rank resumes from, or None to start at step 0 (collective).

    Rank 0 chooses (`checkpoint_manifest.choose`) and broadcasts the step. With `start_over`
    (--overwrite) rank 0 first deletes the old checkpoints; without it, step directories of
    which none verifies are a UserError (a run never silently starts over on top of them).
    """
    code, error = _NONE, None
    if ctx.is_main:
        try:
            if start_over:
                shutil.rmtree(directory, ignore_errors=True)
            choice = choose(directory)
            _report(choice, directory)
            if choice.path is None and choice.candidates:
                raise UserError(_none_verified(choice, directory, "restore one from a copy, or pass --overwrite "
                                                                  "to delete them and start over"))
            code = _NONE if choice.path is None else step_of(choice.path)
        except UserError as e:
            code, error = _FAILED, e
    decided = torch.tensor([code], dtype=torch.int64, device=ctx.device)
    ctx.comm.broadcast(decided, ctx.group("world"))
    if error is not None:
        raise error
    code = int(decided.item())
    if code == _FAILED:
        raise UserError("rank 0 found no usable checkpoint (its message says why)")
    return None if code == _NONE else directory / checkpoint_name(code)


def _report(choice: Choice, directory: Path) -> None:
    lines = choice.report()
    pointer = directory / LATEST
    if choice.path is not None and not pointer.exists():
        lines.append(f"{str(pointer)!r} is missing: using the newest verified checkpoint {choice.path.name}")
    for line in lines:
        logging.getLogger("ndtrain").warning(f"ndtrain: warning: {line}")


def _none_verified(choice: Choice, directory: Path, fix: str) -> str:
    names = ", ".join(p.name for p in choice.candidates)
    return f"no checkpoint in {str(directory)!r} verifies ({names}; newest: {choice.damaged[0][1]}): {fix}"


def _rng_state(device: torch.device) -> dict[str, Any]:
    """The CPU generator's state and, on CUDA, this rank's device's only (a resume may see fewer GPUs)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `_rng_state` saved; a CPU resume of a GPU checkpoint keeps the CPU part only, a GPU resume
    of a CPU checkpoint leaves CUDA's generator as seeded. Checkpoints written before one rank saved its own
    device's state hold every device's list: this rank's device's entry is restored when present."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def save_checkpoint(directory: Path, step: int, engine: Any, extra: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` of `engine` (an `Engine`; collective: every rank calls it) and keep the
    newest `keep` verified. Each rank writes the slices it owns (`format.py`); rank 0 adds
    `extra` (JSON) with the format number and the optimizer's scalar hyperparameters.

    Three phases (prepare the `.partial` directory, write the state, finish: manifest, rename, `latest`,
    rotation), each ended by `settle`, the all-reduce every rank meets: when a rank failed, the
    `.partial` save is removed and a failure that would recur (a full disk, a refused write, a
    UserError) becomes the same UserError on every rank (see `_refused_save`); any other failure is
    re-raised by the rank that met it, the others raising `PeerFailed`.
    """
    import torch.distributed.checkpoint as dcp

    from ndtrain.checkpoint.format import FORMAT, SliceSavePlanner, save_pieces
    from ndtrain.checkpoint.save_agreement import PendingSave, attempt, settle

    ctx = engine.ctx
    save = PendingSave(directory, checkpoint_name(step), save_pieces(engine))
    partial, final = save.partial, directory / save.name

    def prepare() -> None:
        if ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)

    def write() -> None:
        with _single_process_quiet():
            dcp.save({}, checkpoint_id=partial, planner=SliceSavePlanner(save.pieces))
        if ctx.is_main:
            groups = [{k: v for k, v in g.items() if _scalar(v)} for g in engine.optimizer.param_groups]
            record = {**extra, "checkpoint_format": FORMAT, "optimizer_groups": groups}
            (partial / PROGRESS).write_text(json.dumps(record, indent=1))
        rng_dir = partial / "rng"
        rng_dir.mkdir(exist_ok=True)
        with open(rng_dir / f"rank{ctx.rank:05d}.pt", "wb") as file:  # a Python file: a full disk is an OSError
            torch.save(_rng_state(ctx.device), file)
        if all(ctx.coord(axis) == 0 for axis in ("dp", "cp", "tp")):  # one writer per pipeline stage
            write_buffers(partial, ctx.rank, held(engine.buffer_sites, engine.model))

    def finish() -> None:
        if ctx.is_main:
            layout = {axis: ctx.size(axis) for axis in ("dp", "cp", "pp", "tp")} | {"zero": engine.parallel.zero}
            write_manifest(partial, step, layout)
            shutil.rmtree(final, ignore_errors=True)  # only ever an unverified one: resuming takes the newest verified
            partial.rename(final)
            pointer_tmp = directory / (LATEST + PARTIAL)
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, directory / LATEST)
            for path in obsolete(directory, keep, final):
                shutil.rmtree(path, ignore_errors=True)

    for phase in (prepare, write, finish):
        settle(attempt(phase), save, ctx)
    return final


def _scalar(value: Any) -> bool:
    """An optimizer hyperparameter kept in progress.json (lr, weight_decay, ...; not tuples or flags)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_checkpoint(path: Path, engine: Any) -> dict[str, Any]:
    """Restore `engine` (an `Engine`, under any layout) from the verified checkpoint `path`: model,
    optimizer state and hyperparameters, LR schedule, engine state and this rank's RNG; return the
    saved progress.

    Collective: when any rank fails (another model's names or shapes, a missing slice, a refused
    pickle, a checkpoint of the old per-layout format), every rank raises a UserError carrying the
    first failing rank's message before anything is read, so no rank goes on training alone.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ndtrain.checkpoint.format import FORMAT, SliceLoadPlanner, load_pieces, problems
    from ndtrain.checkpoint.safe_pickle import SafeReader, load_tensors
    from ndtrain.checkpoint.save_agreement import agree

    ctx = engine.ctx
    error, extra, metadata = None, {}, None
    try:
        extra = json.loads((path / PROGRESS).read_text())
        if extra.get("checkpoint_format") != FORMAT:
            raise UserError(
                f"checkpoint {str(path)!r} is in the per-layout format of ndtrain before layout-agnostic checkpoints: "
                "resume it with the version that wrote it, or start a new run from its weights (model.init_from)"
            )
        metadata = SafeReader(path).read_metadata()
        error = problems(engine, metadata, str(path))
    except UserError as e:
        error = str(e)
    except (Exception, CheckpointException) as e:  # refused pickles come in many forms
        error = f"cannot load checkpoint {str(path)!r} ({_reason(e)}): restore it from a copy, or use a fresh --out directory"
    agree(error, ctx)
    try:
        with _single_process_quiet():
            dcp.load({}, storage_reader=SafeReader(path), planner=SliceLoadPlanner(load_pieces(engine, metadata)))
        if engine.scheduler is not None and extra.get("scheduler") is not None:
            engine.scheduler.load_state_dict(extra["scheduler"])
        _restore_groups(engine.optimizer, engine.scheduler, extra.get("optimizer_groups", []))
        engine.load_extra_state(extra.get("engine", {}))
        load_buffers(path, held(engine.buffer_sites, engine.model))
        rng_file = path / "rng" / f"rank{ctx.rank:05d}.pt"
        if rng_file.exists():  # a rank beyond the saved world keeps its own RNG
            _set_rng_state(load_tensors(rng_file), ctx.device)
    except UserError as e:
        error = str(e)
    except (Exception, CheckpointException) as e:
        error = f"cannot load checkpoint {str(path)!r} ({_reason(e)}): restore it from a copy, or resume from another"
    agree(error, ctx)
    return extra


_SCHEDULED = ("lr", "initial_lr")  # the hyperparameters an LR schedule changes; the rest come from the config


def _restore_groups(optimizer: torch.optim.Optimizer, scheduler: Any, saved: list[dict[str, Any]]) -> None:
    """Put back each parameter group's scheduled lr from the saved group with the same other
    hyperparameters (the order of groups differs between layouts: a pipeline stage's first
    parameter decides it), else the saved groups' common lr; the schedule's base lrs follow."""
    common = {tuple(values.get(k) for k in _SCHEDULED) for values in saved}
    for group in optimizer.param_groups:
        same = {tuple(values.get(k) for k in _SCHEDULED) for values in saved
                if all(group.get(k) == v for k, v in values.items() if k not in _SCHEDULED)}
        found = same if len(same) == 1 else common
        if len(found) != 1:
            raise UserError("cannot tell which saved learning rate belongs to which optimizer parameter group: "
                            "resume with the parameter groups (optim settings) of the run that wrote the checkpoint")
        group.update({k: v for k, v in zip(_SCHEDULED, next(iter(found))) if v is not None})
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g.get("initial_lr", base) for g, base in zip(optimizer.param_groups, scheduler.base_lrs)]


def _dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """`dcp.load` with `.metadata` and non-tensor items read without arbitrary classes.

    The metadata is read once beforehand so that a refused one fails here, with one line, rather
    than inside DCP, which logs a traceback before falling back to per-rank metadata.
    """
    import torch.distributed.checkpoint as dcp

    from ndtrain.checkpoint.safe_pickle import SafePlanner, SafeReader

    reader = SafeReader(path)
    reader.read_metadata()
    with _single_process_quiet():
        dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=no_dist)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: that is intended for one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _reason(error: BaseException) -> str:
    """One line saying why a load failed; DCP wraps each rank's exception in a CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:160]}" if text else type(error).__name__


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights (parameters and persistent buffers) of a checkpoint into a single-process
    model (no process group)."""
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"model": {name: p.detach() for name, p in model.named_parameters()}}  # a tied weight once
    try:
        _dcp_load(state, path, no_dist=not dist.is_initialized())  # in place, into the parameters
        load_buffers(path, buffer_names(model))
    except (Exception, CheckpointException) as e:
        raise UserError(f"cannot load model weights from {str(path)!r}: {_reason(e)}") from None
