"""`ndtrain export RUN_DIR OUT.safetensors`: a run's whole model as one safetensors file.

The newest verified checkpoint is read into the single-process model (`run_model.load_run`):
every checkpoint holds the full model under its unsharded names (DCP gathers dp, ZeRO-3, tp and
pp runs alike), so one path serves every layout; a task's model (digits) is read and written the
same way (models/build.py builds it). The file holds each parameter under its model name (tied
weights stored under each name) and, in its metadata, the model config as JSON
(`model_config`), the step (`step`), `format: pt` and the run's tokenizer: `tokenizer` its spec
(`bytes`: ids 0..255 are the UTF-8 bytes; or the `hf:PATH` it read) and, for an HF tokenizer,
`tokenizer_json` the tokenizer itself (`tokenizers.Tokenizer.from_str` reads it; absent for a
transformers tokenizer without a `tokenizers` backend). Written to a temporary file beside OUT
and renamed, so a failed export leaves no partial file. Cost: one model in memory, Ψ·4 bytes
written for fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from ndtrain.checkpoint.manifest import PARTIAL, step_of
from ndtrain.checkpoint.run_model import load_run
from ndtrain.data.tokenizer import HFTokenizer, load_tokenizer
from ndtrain.errors import UserError


def export_safetensors(run_dir: Path, out: Path) -> tuple[Path, int]:
    """Write the model of `run_dir`'s newest verified checkpoint to `out`; return that checkpoint and
    the number of tensors written."""
    if out.is_dir():
        raise UserError(f"export output {str(out)!r} is a directory: give a file name such as model.safetensors")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {str(out)!r}: {str(out.parent)!r} is not a directory; create it first")
    cfg, model, checkpoint = load_run(run_dir)
    tensors = {name.removeprefix("hf."): value.detach().cpu().contiguous().clone()
               for name, value in model.state_dict().items()}
    metadata = {"format": "pt", "model_config": json.dumps(dataclasses.asdict(cfg.model), sort_keys=True),
                "step": str(step_of(checkpoint)), **tokenizer_metadata(cfg.data.tokenizer)}
    tmp = out.with_name(out.name + PARTIAL)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        reason = " ".join(str(e).split())[:160]
        raise UserError(f"cannot write {str(out)!r} ({reason}): give a writable file path") from None
    return checkpoint, len(tensors)


def tokenizer_metadata(spec: str) -> dict[str, str]:
    """The safetensors metadata naming the run's tokenizer `spec`, with an HF tokenizer's own JSON."""
    tokenizer = load_tokenizer(spec)
    text = tokenizer.tokenizer_json() if isinstance(tokenizer, HFTokenizer) else None
    return {"tokenizer": spec, **({"tokenizer_json": text} if text is not None else {})}
