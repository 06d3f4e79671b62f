"""`ndtrain export RUN_DIR OUT --format hf`: a run's model as a Hugging Face `save_pretrained` folder.

OUT gets config.json, model.safetensors, generation_config.json (when the model can generate) and,
when the run tokenized with an HF tokenizer (`data.tokenizer = "hf:PATH"`), its tokenizer files,
so `AutoModelForCausalLM.from_pretrained(OUT)` (and `AutoTokenizer`) load it with nothing else.

- An `hf:PATH` run saves its own transformers model (the `CausalLM` wrapper's `hf.` prefix is gone).
- A built-in Llama run is written as `LlamaForCausalLM`: the same architecture (RMSNorm, RoPE on
  the two halves of each head, as HF's `rotate_half`; SwiGLU; grouped-query attention), so the
  conversion is a renaming (`LLAMA_TO_HF`) with no permutation of q/k rows; tests compare logits.

The model comes from the newest verified checkpoint (`load_run`, any layout). Written into
`OUT.partial` and renamed, so a failed export leaves nothing at OUT.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ndtrain.checkpoint.manifest import PARTIAL
from ndtrain.config import ModelConfig
from ndtrain.errors import UserError
from ndtrain.models.hf import require_transformers

# built-in Llama name (regex) → LlamaForCausalLM name
LLAMA_TO_HF: list[tuple[str, str]] = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def _rename(name: str, table: list[tuple[str, str]]) -> str | None:
    for pattern, replacement in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def llama_names_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A built-in Llama state dict under LlamaForCausalLM's names."""
    out = {}
    for name, tensor in state.items():
        hf_name = _rename(name, LLAMA_TO_HF)
        if hf_name is None:
            raise UserError(f"cannot export parameter {name!r} of the built-in model to LlamaForCausalLM")
        out[hf_name] = tensor
    return out


def hf_names_to_llama(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `llama_names_to_hf`; names it does not know are kept (and refused by the caller)."""
    inverse = [(re.escape(hf).replace(r"\\1", r"(\d+)"), ours.replace(r"(\d+)", r"\1").replace("\\.", "."))
               for ours, hf in LLAMA_TO_HF]
    return {(_rename(name, inverse) or name): tensor for name, tensor in state.items()}


def llama_hf_config(cfg: ModelConfig) -> Any:
    """The `LlamaConfig` of a built-in Llama with these sizes."""
    transformers = require_transformers()
    return transformers.LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.n_heads,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )


def builtin_to_hf(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A `LlamaForCausalLM` holding the built-in model's weights (fp32)."""
    transformers = require_transformers()
    hf_model = transformers.LlamaForCausalLM(llama_hf_config(cfg)).to(torch.float32)
    hf_model.load_state_dict(llama_names_to_hf(model.state_dict()), strict=True)
    return hf_model.eval()


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
    from ndtrain.generate import load_run
    from ndtrain.models.hf import is_hf_model

    if out.exists():
        raise UserError(f"export output {str(out)!r} already exists: give a new folder name")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {str(out)!r}: {str(out.parent)!r} is not a directory; create it first")
    cfg, model, checkpoint = load_run(run_dir)
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
