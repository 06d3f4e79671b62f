"""`ndtrain export RUN_DIR OUT --format hf`: a run's model as a Hugging Face `save_pretrained` folder.

OUT gets config.json, model.safetensors, generation_config.json (when the model can generate) and the
tokenizer the run used, so `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer` load it
with nothing else (data/tokenizer.py, each tokenizer's `save_pretrained`): an HF tokenizer
(`data.tokenizer = "hf:PATH"`) as transformers saves it; the byte tokenizer as a byte-level BPE that
maps text to the same ids, ids 0..255 = the UTF-8 bytes (`byte_level_tokenizer`). Training
`--model hf:OUT` then uses that tokenizer again (`bytes` for the latter).

- An `hf:PATH` run saves its own transformers model (the `CausalLM` wrapper's `hf.` prefix is gone).
- A built-in Llama run is written as `LlamaForCausalLM`: the same architecture, so the conversion is
  a renaming with no permutation of q/k rows (models/llama_hf.py); tests compare logits.
- A LoRA run's adapters are merged into their base weights (W + B A · alpha/r, lora.py `merge_lora`);
  `--format peft` (export_peft.py) writes them apart instead.

The model comes from the newest verified checkpoint (`run_model.load_run`, any layout). Written into
`OUT.partial` and renamed, so a failed export leaves nothing at OUT.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable

from ndtrain.checkpoint.manifest import PARTIAL
from ndtrain.checkpoint.run_model import load_run
from ndtrain.config.presets import TASK_PRESETS
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import UserError
from ndtrain.models.hf import is_hf_model, require_transformers
from ndtrain.models.llama_hf import builtin_to_hf
from ndtrain.parallel.model.lora import merge_lora


def export_hf(run_dir: Path, out: Path) -> tuple[Path, list[str]]:
    """Write RUN_DIR's newest verified checkpoint as a save_pretrained folder OUT; return the checkpoint
    and the names of the files written."""
    check_new_folder(out)
    cfg, model, checkpoint = load_run(run_dir)
    if cfg.model.preset in TASK_PRESETS:
        raise UserError(f"--format hf holds language models; {str(run_dir)!r} trained --model {cfg.model.preset}: "
                        "export it with --format safetensors")
    require_transformers().utils.logging.disable_progress_bar()  # this process only writes the export
    model = merge_lora(model)  # a LoRA run's adapters folded into the base weights
    hf_model = model.hf if is_hf_model(cfg.model.preset) else builtin_to_hf(model, cfg.model)
    tokenizer = load_tokenizer(cfg.data.tokenizer)  # refused here, before OUT.partial, if it is gone
    def write(tmp: Path) -> None:
        hf_model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(tmp)

    return checkpoint, write_folder(out, write)


def check_new_folder(out: Path) -> None:
    """UserError unless `out` can be made as a new folder (it does not exist; its parent is a folder)."""
    if out.exists():
        raise UserError(f"export output {str(out)!r} already exists: give a new folder name")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {str(out)!r}: {str(out.parent)!r} is not a directory; create it first")


def write_folder(out: Path, write: Callable[[Path], None]) -> list[str]:
    """Have `write` fill a fresh `OUT.partial` folder, then rename it to the new folder `out`; return the
    names it holds. A failed write leaves nothing behind and ends in one UserError line."""
    tmp = out.with_name(out.name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        tmp.rename(out)
    except OSError as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise UserError(f"cannot write {str(out)!r} ({' '.join(str(e).split())[:160]}): give a writable folder") from None
    return sorted(p.name for p in out.iterdir())
