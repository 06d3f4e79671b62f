"""`model.init_from` / `ndtrain train --init-from PATH`: start a run from existing weights (fine-tuning).

PATH is a Hugging Face `save_pretrained` folder (model.safetensors, or the shards its
model.safetensors.index.json lists) or one .safetensors file (`ndtrain export` output). Only
safetensors are read: nothing is unpickled. The weights go into the freshly built model before any
parallelism, so every layout starts from them; the optimizer and the step start fresh (step 0).

Names are matched after undoing the known renamings: the `CausalLM` wrapper's `hf.` prefix, and
HF `LlamaForCausalLM` names for the built-in Llama (models/llama_hf.py). Tied parameters need
one of their names present. Any missing, unexpected or differently shaped tensor is refused in one
line listing the first few.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ndtrain.errors import UserError
from ndtrain.models.causal_lm import CausalLM
from ndtrain.models.llama_hf import hf_names_to_llama

_SHOWN = 4


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file or of an HF folder's (possibly sharded) safetensors."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise UserError(f"--init-from: {str(index)!r} is not a safetensors index (no weight_map)") from None
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise UserError(f"--init-from {str(path)!r} holds no model.safetensors: give a save_pretrained folder "
                            "or a .safetensors file")
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(_load(path / name))
        return state
    return _load(path)


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise UserError(f"--init-from: cannot read {str(file)!r} as safetensors ({' '.join(str(e).split())[:120]})") from None


def _to_model_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` under `model`'s state-dict names, undoing the `hf.` prefix or HF Llama naming."""
    state = {name.removeprefix("hf."): t for name, t in state.items()}
    if isinstance(model, CausalLM):
        return {f"hf.{name}": t for name, t in state.items()}
    if "model.embed_tokens.weight" in state:
        return hf_names_to_llama(state)
    return state


def _first(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


@torch.no_grad()
def load_init_weights(model: nn.Module, path: Path) -> None:
    """Copy the weights at `path` into `model` (every tensor of its state dict), refusing any mismatch."""
    source = _to_model_names(read_weights(path), model)
    targets = model.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        tied.setdefault(id(tensor), []).append(name)
    missing, wrong = [], []
    for names in tied.values():
        present = [n for n in names if n in source]
        if not present:
            missing.append(names[0])
            continue
        value, target = source[present[0]], targets[names[0]]
        if value.shape != target.shape:
            wrong.append(f"{present[0]} {tuple(value.shape)} vs {tuple(target.shape)}")
    unexpected = sorted(set(source) - set(targets))
    problems = [f"missing {_first(missing)}" if missing else "", f"unexpected {_first(unexpected)}" if unexpected else "",
                f"shapes differ: {_first(wrong)}" if wrong else ""]
    if any(problems):
        raise UserError(f"--init-from {str(path)!r} does not fit this model: {'; '.join(p for p in problems if p)}: "
                        "give weights exported from the same model and sizes")
    for names in tied.values():
        value = source[next(n for n in names if n in source)]
        targets[names[0]].copy_(value)
