"""`ndtrain export RUN_DIR OUT --format hf`: a run's model as a Hugging Face `save_pretrained` folder.

OUT gets config.json, model.safetensors, generation_config.json (when the model can generate) and,
when the run tokenized with an HF tokenizer (`data.tokenizer = "hf:PATH"`), its tokenizer files,
so `AutoModelForCausalLM.from_pretrained(OUT)` (and `AutoTokenizer`) load it with nothing else.

- An `hf:PATH` run saves its own transformers model (the `CausalLM` wrapper's `hf.` prefix is gone).
- A built-in Llama run is written as `LlamaForCausalLM`: the same architecture, so the conversion is
  a renaming with no permutation of q/k rows (models/llama_hf.py); tests compare logits.

The model comes from the newest verified checkpoint (`run_model.load_run`, any layout). Written into
`OUT.partial` and renamed, so a failed export leaves nothing at OUT.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ndtrain.checkpoint.manifest import PARTIAL
from ndtrain.checkpoint.run_model import load_run
from ndtrain.config.presets import TASK_PRESETS
from ndtrain.errors import UserError
from ndtrain.models.hf import is_hf_model, require_transformers
from ndtrain.models.llama_hf import builtin_to_hf


def write_tokenizer(spec: str, out: Path) -> bool:
    """Save the run's tokenizer into `out` when `spec` is `hf:PATH` (tokenizer.json or a tokenizer folder)."""
    if not spec.startswith("hf:"):
        return False
    transformers = require_transformers()
    path = Path(spec[3:])
    if path.is_file():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer.save_pretrained(str(out))
    return True


def export_hf(run_dir: Path, out: Path) -> tuple[Path, list[str]]:
    """Write RUN_DIR's newest verified checkpoint as a save_pretrained folder OUT; return the checkpoint
    and the names of the files written."""
    if out.exists():
        raise UserError(f"export output {str(out)!r} already exists: give a new folder name")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {str(out)!r}: {str(out.parent)!r} is not a directory; create it first")
    cfg, model, checkpoint = load_run(run_dir)
    if cfg.model.preset in TASK_PRESETS:
        raise UserError(f"--format hf holds language models; {str(run_dir)!r} trained --model {cfg.model.preset}: "
                        "export it with --format safetensors")
    require_transformers().utils.logging.disable_progress_bar()  # this process only writes the export
    hf_model = model.hf if is_hf_model(cfg.model.preset) else builtin_to_hf(model, cfg.model)
    tmp = out.with_name(out.name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf_model.save_pretrained(str(tmp))
        write_tokenizer(cfg.data.tokenizer, tmp)
        tmp.rename(out)
    except OSError as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise UserError(f"cannot write {str(out)!r} ({' '.join(str(e).split())[:160]}): give a writable folder") from None
    return checkpoint, sorted(p.name for p in out.iterdir())
