"""Hugging Face causal LMs as ndtrain models: `model.preset = "hf:PATH"`.

PATH is a local directory holding a transformers `config.json` (what `save_pretrained` writes).
The model is built with `AutoModelForCausalLM` from that config, in fp32, with SDPA attention:
- weights in PATH (`model.safetensors` or a sharded `model.safetensors.index.json`) are loaded
  with `from_pretrained(local_files_only=True)`; pickled weights alone (`pytorch_model.bin`) are
  refused, never unpickled nor replaced by random ones (hf_weights.py, which also checks the files'
  headers, sizes and shapes in the launcher);
- without weights, a seeded init: `torch.manual_seed(seed)` right before construction, in a forked
  RNG, so every rank of every layout builds bit-identical weights.
Nothing is downloaded. It comes back wrapped in `CausalLM` (tokens → logits → the shifted
cross-entropy, once), so its state-dict keys start with `hf.`.

`config_sizes` reads config.json as plain JSON (no transformers import) for the typed config:
sizes, vocabulary and the longest sequence the model takes (`max_position_embeddings`, GPT-2's
`n_positions`). `check_hf_model` is what the launcher runs before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.models.causal_lm import CausalLM
from ndtrain.models.hf_families import family_of
from ndtrain.models.hf_weights import check_hf_weights, weight_files

PREFIX = "hf:"
INSTALL = "pip install 'ndtrain[hf]'"
BUILD_OPTIONS: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}  # how every rank builds it

# ModelConfig field ← config.json keys, first present wins (Llama/Qwen2 names, then GPT-2's).
_SIZE_KEYS: dict[str, tuple[str, ...]] = {
    "dim": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def is_hf_model(preset: str) -> bool:
    """Whether a `model.preset` names a Hugging Face model directory (`hf:PATH`)."""
    return preset.startswith(PREFIX)


def hf_path(preset: str) -> Path:
    """The directory of an `hf:PATH` preset."""
    return Path(preset[len(PREFIX):])


def read_hf_config(path: Path) -> dict[str, Any]:
    """PATH/config.json as a dict; a missing or unreadable one is a UserError naming the fix."""
    file = path / "config.json"
    if not path.is_dir():
        raise UserError(f"--model hf:{path}: {str(path)!r} is not a directory: give a folder holding a transformers config.json")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"--model hf:{path}: no config.json in {str(path)!r}: give the folder save_pretrained wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--model hf:{path}: cannot read {str(file)!r} ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UserError(f"--model hf:{path}: {str(file)!r} has no model_type: it is not a transformers config")
    return config


def max_positions(config: dict[str, Any]) -> int | None:
    return next((int(config[k]) for k in _MAX_POSITION_KEYS if isinstance(config.get(k), int)), None)


def config_sizes(path: Path) -> dict[str, Any]:
    """ModelConfig values an HF config decides (sizes, vocabulary, tying), read from config.json."""
    config = read_hf_config(path)
    sizes: dict[str, Any] = {}
    for field, keys in _SIZE_KEYS.items():
        value = next((config[k] for k in keys if isinstance(config.get(k), int)), None)
        if value is None:
            raise UserError(f"--model hf:{path}: config.json has none of {', '.join(keys)}: it is not a causal LM config")
        sizes[field] = value
    sizes["n_kv_heads"] = config.get("num_key_value_heads") or sizes["n_heads"]
    sizes["ffn_dim"] = config.get("intermediate_size") or config.get("n_inner") or 4 * sizes["dim"]
    sizes["tie_embeddings"] = bool(config.get("tie_word_embeddings", config.get("model_type") == "gpt2"))
    longest = max_positions(config)
    sizes["seq_len"] = min(128, longest) if longest else 128
    return sizes


def check_seq_len(path: Path, seq_len: int) -> None:
    longest = max_positions(read_hf_config(path))
    if longest is not None and seq_len > longest:
        raise UserError(
            f"model.seq_len={seq_len} exceeds the {longest} positions of the HF model in {str(path)!r}: "
            f"use model.seq_len <= {longest}"
        )


def require_transformers() -> Any:
    """The transformers module, or a UserError naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise UserError(f"--model hf:... needs the transformers package: {INSTALL}") from None
    return transformers


def _auto_config(path: Path) -> Any:
    transformers = require_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"--model hf:{path}: transformers cannot read its config.json ({' '.join(str(e).split())[:160]})") from None


def check_hf_model(path: Path, seq_len: int, parallel: ParallelConfig | None = None) -> str:
    """The launcher's checks before workers start (sizes; the layout's strategies against what the model's
    family supports; the weight files against the config's model, hf_weights.py), so a refusal comes
    before any worker starts; returns the model class name."""
    check_seq_len(path, seq_len)
    model = _meta_model(path)
    if parallel is not None:
        check_family_supports(model, parallel)
    check_hf_weights(path, model)
    return type(model).__name__


def _meta_model(path: Path) -> torch.nn.Module:
    """The HF model of PATH built on the meta device (no memory, no init) with the options workers build
    it with (fp32, SDPA); a one-line error if it cannot be. transformers' warnings about the config are
    left to the workers, which build the same model: the launcher's checks end in one line."""
    transformers = require_transformers()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        config = _auto_config(path)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, **BUILD_OPTIONS)
    except (ValueError, KeyError) as e:
        raise UserError(f"--model hf:{path}: not a causal LM transformers can build ({' '.join(str(e).split())[:160]})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_family_supports(model: torch.nn.Module, parallel: ParallelConfig) -> None:
    """tp needs a tensor-parallel plan (declared by the family's config, or hand-written), pp and cp the
    family's structure (its declared pipeline plan, or a hand-written record): refused in one line naming
    the axis and what the family lacks. pp is cut by parameters only."""
    family = family_of(model)
    model_type = model.config.model_type
    if family is None:
        lacks = ("its config declares no pipeline plan (base_model_pp_plan), so ndtrain does not know its "
                 "embedding, layers and head")
        for axis, what, degree in (("tp", "tensor parallel", parallel.tp), ("pp", "pipeline parallel", parallel.pp),
                                   ("cp", "context parallel", parallel.cp)):
            if degree > 1:
                raise UserError(f"--{axis} {degree}: {what} is not supported for model type {model_type!r}: {lacks}; "
                                "use dp/ZeRO (every family trains under them)")
    elif parallel.tp > 1 and family.tp_plan is None:
        raise UserError(f"--tp {parallel.tp}: {family.tp_refusal}")
    if parallel.pp > 1 and parallel.pp_balance == "measured":  # the launcher's layout dry run cuts by parameters
        raise UserError("pipeline balance 'measured' is not supported for Hugging Face models: use 'params'")


def hf_model_type(path: Path) -> str:
    """config.json's model_type (llama, qwen2, gpt2, ...)."""
    return str(read_hf_config(path)["model_type"])


def parameter_count(path: Path) -> int:
    """Ψ of the HF model, from a construction on the meta device (no memory, no init)."""
    return sum(p.numel() for p in _meta_model(path).parameters())


def build_hf_model(path: Path, seed: int) -> torch.nn.Module:
    """The `CausalLM` of PATH: its weights when present, else seeded init (identical on every rank)."""
    transformers = require_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if weight_files(path):  # refuses a folder whose only weights are pickled
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **BUILD_OPTIONS)
        else:
            model = transformers.AutoModelForCausalLM.from_config(_auto_config(path), **BUILD_OPTIONS)
    return CausalLM(model)


def build_meta_hf_model(path: Path) -> torch.nn.Module:
    """The `CausalLM` of PATH on the meta device: the structure and shapes workers build, no memory, no weights read."""
    return CausalLM(_meta_model(path))
