"""`ndtrain inspect RUN_DIR`: what a run directory holds, without loading any weights.

Prints the model (preset, or the HF folder and its model_type, with the parameter count) with the
sizes that apply to it (the language model's seq_len; a task's own model keys, e.g. digits'
model.dim), the layout and step of the newest verified checkpoint (from its manifest), the items
trained on in the task's unit (tokens, images: the checkpoint's progress.json; runs from before
either was recorded say so) and each model tensor's name, shape and dtype, read from the
checkpoint's DCP `.metadata` through `safe_pickle` (the restricted unpickler: DCP metadata classes
only). Cost: one hash of the checkpoint's files (verification).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ndtrain.checkpoint.store import PROGRESS, newest_verified
from ndtrain.checkpoint.manifest import MANIFEST
from ndtrain.run.config_checks import resolve_config
from ndtrain.errors import UserError
from ndtrain.models.build import model_label
from ndtrain.checkpoint.safe_pickle import SafeReader, UnsafePickle
from ndtrain.config.presets import TASK_PRESETS

_MODEL = "model."


def model_tensors(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each model tensor of a checkpoint: name → (shape, dtype), from its DCP metadata."""
    try:
        metadata = SafeReader(checkpoint).read_metadata()
    except (OSError, UnsafePickle, EOFError, ValueError) as e:
        raise UserError(f"cannot read the DCP metadata of {str(checkpoint)!r} ({type(e).__name__}: {e})") from None
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL) and isinstance(item, TensorStorageMetadata):
            out[key[len(_MODEL):]] = (tuple(item.size), str(item.properties.dtype).removeprefix("torch."))
    return out


def _layout(checkpoint: Path) -> str:
    layout = json.loads((checkpoint / MANIFEST).read_text()).get("layout") or {}
    axes = " × ".join(f"{axis}={layout[axis]}" for axis in ("dp", "cp", "pp", "tp") if axis in layout)
    return f"{axes}, zero={layout.get('zero', '?')}" if axes else "not recorded"


def _parameters(tensors: dict[str, tuple[tuple[int, ...], str]]) -> str:
    total = sum(math.prod(shape) for shape, _ in tensors.values())
    return f"{total:,} elements in {len(tensors)} tensors (a tied weight under its first name)"


def _trained_on(progress: dict[str, object], language_model: bool) -> tuple[str, str]:
    """The row of what was trained on: (unit, count); the count's key is "tokens" whatever the unit."""
    count, unit = progress.get("tokens"), progress.get("unit", "tokens" if language_model else None)
    if not isinstance(count, int):
        return unit if isinstance(unit, str) else "trained on", "not recorded (checkpoint older than the record)"
    if not isinstance(unit, str):
        return "trained on", f"{count:,} items (unit not recorded: checkpoint older than the record)"
    return unit, f"{count:,}"


def inspect_run(run_dir: Path) -> str:
    """The report `ndtrain inspect` prints."""
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise UserError(f"{str(run_dir)!r} is not an ndtrain run directory (no config.toml): give the --out of a run")
    cfg = resolve_config(config_file)
    task = TASK_PRESETS.get(cfg.model.preset)
    rows = [("run", str(run_dir)), ("model", model_label(cfg.model))]
    if task is None:
        rows.append(("seq_len", str(cfg.model.seq_len)))
    else:
        rows += [(f"model.{key}", str(getattr(cfg.model, key))) for key in task.get("model", {})]
    if cfg.model.init_from:
        rows.append(("init from", cfg.model.init_from))
    checkpoint = newest_verified(run_dir / "checkpoints")
    if checkpoint is None:
        rows.append(("checkpoint", "none yet"))
        return _table(rows)
    progress = json.loads((checkpoint / PROGRESS).read_text())
    tensors = model_tensors(checkpoint)
    rows += [
        ("checkpoint", f"{checkpoint.name} (verified)"),
        ("step", f"{progress.get('step', '?')} of {cfg.schedule.steps}"),
        ("layout", _layout(checkpoint)),
        ("world size", str(progress.get("world_size", "?"))),
        _trained_on(progress, task is None),
        ("parameters", _parameters(tensors)),
    ]
    width = max(len(name) for name in tensors) if tensors else 0
    lines = [f"  {name:<{width}}  {'×'.join(map(str, shape)) or 'scalar':<14} {dtype}" for name, (shape, dtype) in tensors.items()]
    return _table(rows) + "\ntensors:\n" + "\n".join(lines)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
