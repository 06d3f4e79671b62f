"""Resuming on other data: refused in one line unless `data.allow_change`, which restarts the data order.

A checkpoint's progress.json holds the fingerprint of the data it was trained on (`data`,
data/identity.py) and the step its data order started at (`data_start`: 0, or the step a changed
data set took over). The data position a resume restores counts windows of that data, so on other
data it would be meaningless: `check_resume_data` refuses it in the launcher, before anything is
written (the newest finished checkpoint's progress.json against the config's data: equal identities
pass at once; different ones are tokenized into a scratch folder, so moved or touched files of the
same data pass and the run's token file is untouched), and the trainer's resume decides again with the
checkpoint it actually loads (`data_start_after_resume`). A checkpoint from before fingerprints has
none and is resumed unchecked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ndtrain.checkpoint.manifest import MANIFEST, step_dirs
from ndtrain.checkpoint.store import PROGRESS
from ndtrain.config import TrainConfig
from ndtrain.data.identity import Fingerprint, identity_digest, same_data
from ndtrain.data.prepare import check_data
from ndtrain.errors import UserError


def check_resume_data(cfg: TrainConfig, run_dir: Path) -> None:
    """The launcher's refusal of a resume on other data (nothing written; the trainer checks again)."""
    if cfg.checkpoint.overwrite or cfg.data.allow_change:
        return
    found = newest_saved_fingerprint(run_dir / "checkpoints")
    if found is None:
        return
    checkpoint, saved = found
    if saved.get("identity") == identity_digest(cfg.data, cfg.model.seq_len):
        return
    current = check_data(cfg, write=False)  # tokenized into a scratch folder
    if not same_data(saved, current):
        raise data_change_refusal(checkpoint, saved, current)


def newest_saved_fingerprint(checkpoints: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest finished checkpoint and the data fingerprint its progress.json records (None: none
    recorded, or nothing readable: the trainer decides with the checkpoint it verifies and loads)."""
    for step in step_dirs(checkpoints):
        if not (step / MANIFEST).is_file():
            continue
        try:
            saved = json.loads((step / PROGRESS).read_text()).get("data")
        except (OSError, ValueError, AttributeError):
            return None
        return (step, saved) if isinstance(saved, dict) else None
    return None


def data_start_after_resume(progress: dict[str, Any], checkpoint: Path, step: int, current: Fingerprint | None,
                            allow_change: bool) -> tuple[int, str | None]:
    """The step the data order counts from after resuming `checkpoint` at `step`, and a warning line
    when the data changed (allowed); other data without `allow_change` is a UserError."""
    saved = progress.get("data")
    if same_data(saved, current):
        return int(progress.get("data_start", 0)), None
    if not allow_change:
        raise data_change_refusal(checkpoint, saved, current)
    return step, (f"resuming step {step} on other data than {checkpoint.name} was trained on ({saved['source']}); "
                  f"data.allow_change=true: the data order restarts at the first batch of the new data")


def data_change_refusal(checkpoint: Path, saved: dict[str, Any], current: Fingerprint | None) -> UserError:
    now = current["source"] if current else "other data"
    return UserError(
        f"checkpoint {str(checkpoint)!r} was trained on other data ({saved.get('source')}) than this run's ({now}): "
        "resume with the same --data and tokenizer, or --set data.allow_change=true to continue on these data "
        "from their first batch"
    )
