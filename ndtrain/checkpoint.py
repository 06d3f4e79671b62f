"""Checkpoints with `torch.distributed.checkpoint` (DCP): layout-agnostic, written atomically.

Layout of RUN_DIR/checkpoints:
    step_00000050/          one DCP checkpoint of model and optimizer state
        progress.json       trainer progress and LR schedule (JSON, written by rank 0)
        rng/rank00000.pt    each rank's RNG states (written by that rank only)
    latest                  name of the newest complete checkpoint

A checkpoint is written into `step_XXXXXXXX.partial`, and only after every rank has finished
is it renamed and `latest` replaced (os.replace), so a crash mid-save never damages the
previous checkpoint. Model and optimizer state go through DCP's `get_state_dict`, keyed by
parameter name, so a checkpoint can be loaded under another layout. DCP writes each replicated
tensor once (deduplicated across ranks); cost: Ψ·(4 + 8) bytes for fp32 AdamW on disk.

Sharded runs resume only under the same layout: with a sharded optimizer (ZeRO 1/2, mixed
precision's fp32 masters) each rank writes its own optimizer state to `optim/rankNNNNN.pt`; with
a sharded model (ZeRO-3, an object with `sharded_state_dict`/`load_sharded_state_dict`/
`full_state_dict`) each rank also writes its parameter shards to `model/rankNNNNN.pt`, which is
what resuming reads; the gathered full model still goes through DCP (written once, by
deduplication), so `load_model_weights` (generate, eval) reads any checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext

LATEST = "latest"
PARTIAL = ".partial"
PROGRESS = "progress.json"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in `directory`, or None when there is none."""
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    if not (path / ".metadata").exists():
        raise UserError(
            f"checkpoint {str(path)!r} named by {str(pointer)!r} is missing or incomplete: "
            f"restore it or delete {str(pointer)!r} to start over"
        )
    return path


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
    """Write checkpoint `step` (collective: every rank calls it) and keep the newest `keep`.

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
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        pointer_tmp = directory / (LATEST + PARTIAL)
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, directory / LATEST)
        old = sorted(p for p in directory.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL))
        for path in old[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    ctx.comm.barrier(ctx.group("world"))
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
    sharded_optimizer: bool = False, sharded_model: Any = None,
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path`; return the saved progress."""
    state = _dcp_state(model, optimizer, sharded_optimizer)
    shard_file = path / "optim" / f"rank{ctx.rank:05d}.pt"
    try:
        extra = json.loads((path / PROGRESS).read_text())
        if sharded_model is not None:
            sharded_model.load_sharded_state_dict(torch.load(path / "model" / f"rank{ctx.rank:05d}.pt", weights_only=False))
        else:
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=path)
        shard = torch.load(shard_file, weights_only=False) if sharded_optimizer else None
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # corrupt files and shape mismatches come in many forms
        raise UserError(
            f"cannot load checkpoint {str(path)!r} ({_reason(e)}): it is corrupt or was written "
            f"for another model; use a fresh --out directory"
        ) from None
    if shard is None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        if sharded_model is None:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(shard)
    rng_file = path / "rng" / f"rank{ctx.rank:05d}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return extra


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
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise UserError(f"cannot load model weights from {str(path)!r}: {_reason(e)}") from None
    model.load_state_dict(state["model"])
