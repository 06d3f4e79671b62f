"""Checkpoints with `torch.distributed.checkpoint` (DCP): layout-agnostic, atomic, verified.

Layout of RUN_DIR/checkpoints:
    step_00000050/          one DCP checkpoint of model and optimizer state
        progress.json       trainer progress and LR schedule (JSON, written by rank 0)
        rng/rank00000.pt    each rank's RNG states (written by that rank only)
        manifest.json       every file's size and SHA-256, step, layout, versions (written last)
    latest                  name of the newest complete checkpoint

A checkpoint is written into `step_XXXXXXXX.partial`; after every rank has finished, rank 0
writes the manifest (`checkpoint_manifest`), renames the directory and replaces `latest`
(os.replace), so a crash mid-save never damages the previous checkpoint. Resuming uses the
newest checkpoint that verifies against its manifest, naming each damaged one; rotation keeps the
newest `keep` verified checkpoints. Model and optimizer state go through DCP's `get_state_dict`,
keyed by parameter name, so a checkpoint can be loaded under another layout. DCP writes each
replicated tensor once (deduplicated across ranks); cost: Ψ·(4 + 8) bytes for fp32 AdamW on disk.
Nothing is unpickled with arbitrary classes (`safe_pickle`).

Sharded runs resume only under the same layout: with a sharded optimizer (ZeRO 1/2, mixed
precision's fp32 masters) each rank writes its own optimizer state to `optim/rankNNNNN.pt`; with
a sharded model (ZeRO-3, an object with `sharded_state_dict`/`load_sharded_state_dict`/
`full_state_dict`) each rank also writes its parameter shards to `model/rankNNNNN.pt`, which is
what resuming reads; the gathered full model still goes through DCP (written once, by
deduplication), so `load_model_weights` (generate, eval, export) reads any checkpoint.
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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ndtrain.checkpoint_manifest import PARTIAL, Choice, choose, obsolete, step_of, write_manifest
from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.safe_pickle import SafePlanner, SafeReader, load_tensors

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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
    extra: dict[str, Any], ctx: ParallelContext, keep: int, sharded_optimizer: bool = False,
    sharded_model: Any = None,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and keep the newest `keep` verified.

    With `sharded_optimizer` (ZeRO) each rank writes its own optimizer shard to
    `optim/rankNNNNN.pt`; such a checkpoint resumes only under the same dp×cp size.
    """
    final = directory / checkpoint_name(step)
    partial = directory / (checkpoint_name(step) + PARTIAL)
    if ctx.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    ctx.comm.barrier(ctx.group("world"))
    state = {"model": sharded_model.full_state_dict()} if sharded_model is not None else _dcp_state(
        model, optimizer, sharded_optimizer)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=partial)
    if sharded_model is not None:
        (partial / "model").mkdir(exist_ok=True)
        torch.save(sharded_model.sharded_state_dict(), partial / "model" / f"rank{ctx.rank:05d}.pt")
    if sharded_optimizer:
        (partial / "optim").mkdir(exist_ok=True)
        torch.save(optimizer.state_dict(), partial / "optim" / f"rank{ctx.rank:05d}.pt")
    if ctx.is_main:
        (partial / PROGRESS).write_text(json.dumps(extra, indent=1))
    rng_dir = partial / "rng"
    rng_dir.mkdir(exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank{ctx.rank:05d}.pt")
    ctx.comm.barrier(ctx.group("world"))
    if ctx.is_main:
        layout = {axis: ctx.size(axis) for axis in ("dp", "cp", "pp", "tp")} | {"zero": ctx.config.zero}
        write_manifest(partial, step, layout)
        shutil.rmtree(final, ignore_errors=True)  # only ever an unverified one: resuming takes the newest verified
        partial.rename(final)
        pointer_tmp = directory / (LATEST + PARTIAL)
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, directory / LATEST)
        for path in obsolete(directory, keep, final):
            shutil.rmtree(path, ignore_errors=True)
    ctx.comm.barrier(ctx.group("world"))
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
    sharded_optimizer: bool = False, sharded_model: Any = None,
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from the verified checkpoint `path`; return the saved progress.

    Collective: when any rank fails (a refused pickle, another model's shapes, another layout's
    shards), every rank raises a UserError carrying the first failing rank's message, so no rank
    goes on training alone.
    """
    error, extra = None, {}
    try:
        extra = _load(path, model, optimizer, ctx, sharded_optimizer, sharded_model)
    except UserError as e:
        error = str(e)
    except (Exception, CheckpointException) as e:  # refused pickles and shape mismatches come in many forms
        error = (f"cannot load checkpoint {str(path)!r} ({_reason(e)}): it was written for another model or "
                 f"holds objects other than tensors; use a fresh --out directory")
    _agree(error, ctx)
    return extra


def _load(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
    sharded_optimizer: bool, sharded_model: Any,
) -> dict[str, Any]:
    extra = json.loads((path / PROGRESS).read_text())
    state = _dcp_state(model, optimizer, sharded_optimizer)
    if sharded_model is not None:
        sharded_model.load_sharded_state_dict(load_tensors(path / "model" / f"rank{ctx.rank:05d}.pt"))
    else:
        _dcp_load(state, path)
    if sharded_optimizer:
        if sharded_model is None:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(load_tensors(path / "optim" / f"rank{ctx.rank:05d}.pt"))
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = path / "rng" / f"rank{ctx.rank:05d}.pt"
    if rng_file.exists():
        _set_rng_state(load_tensors(rng_file))
    return extra


_MESSAGE_BYTES = 1024


def _agree(error: str | None, ctx: ParallelContext) -> None:
    """Raise a UserError on every rank when any rank has `error` (one all-reduce of world × 1 KiB)."""
    messages = torch.zeros(ctx.world_size, _MESSAGE_BYTES, dtype=torch.uint8, device=ctx.device)
    if error is not None:
        encoded = error.encode()[:_MESSAGE_BYTES] or b"?"
        messages[ctx.rank, : len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    ctx.comm.all_reduce(messages, ctx.group("world"))  # one writer per row: the sum is that row
    failed = [rank for rank in range(ctx.world_size) if bool(messages[rank].any())]
    if error is not None:
        raise UserError(error)
    if failed:
        first = bytes(messages[failed[0]].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        raise UserError(f"rank {failed[0]}: {first}")


def _dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """`dcp.load` with `.metadata` and non-tensor items read without arbitrary classes.

    The metadata is read once beforehand so that a refused one fails here, with one line, rather
    than inside DCP, which logs a traceback before falling back to per-rank metadata.
    """
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
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:160]}" if text else type(error).__name__


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer, sharded_optimizer: bool) -> dict[str, Any]:
    """What goes through DCP: the model, and the optimizer unless each rank keeps its own shard."""
    if sharded_optimizer:
        return {"model": model.state_dict()}
    model_state, optim_state = _state_templates(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _state_templates(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP state dicts to load into, with the optimizer's state tensors allocated.

    DCP materialises a fresh optimizer's state only when no parameter has a gradient; our
    data-parallel wrapper keeps gradients as views into its buckets, so they are set aside
    for the call and put back afterwards.
    """
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    if not optimizer.state:
        for p in params:
            p.grad = None
    try:
        return get_state_dict(model, optimizer)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint into a single-process model (no process group)."""
    state = {"model": model.state_dict()}
    try:
        _dcp_load(state, path, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise UserError(f"cannot load model weights from {str(path)!r}: {_reason(e)}") from None
    model.load_state_dict(state["model"])
