"""Hugging Face causal LMs as ndtrain models: `model.preset = "hf:PATH"`.

PATH is a local directory holding a transformers `config.json` (what `save_pretrained` writes).
The model is built with `AutoModelForCausalLM` from that config, in fp32, with the attention
implementation `model.attention` names (`resolve_attention`): `auto` is SDPA where the family's class
supports it (`_supports_sdpa`), else eager (Gemma2, whose soft-capped attention SDPA cannot do); an
explicit `sdpa` or `eager` the class does not support is one line. The run's config records the
implementation chosen (config.toml; `auto` resolved), and under context parallel the ring replaces it
(hf_context.py). Building:
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
`n_positions`). `check_hf_model` is what the launcher runs before any worker starts: the model built
on the meta device with the run's options, and every refusal of the layout's model-parallel axes that the
family decides, one line naming the axis (`--pp 2: ...`): a family without plans, a model a pipeline cannot
cut (hf_stages.py), an attention ring attention cannot replace (hf_context.py, checked layer by layer on the
meta model with the run's sequence length). A transformers error while building is a UserError, here as in
the workers, so a run never restarts on it (ndtrain/failures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.models.causal_lm import CausalLM
from ndtrain.models.hf_context import check_context_attention
from ndtrain.models.hf_families import family_of
from ndtrain.models.hf_stages import pipeline_refusal
from ndtrain.models.hf_weights import check_hf_weights, weight_files

PREFIX = "hf:"
INSTALL = "pip install 'ndtrain[hf]'"

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


def check_hf_model(path: Path, seq_len: int, parallel: ParallelConfig | None = None, attention: str = "auto") -> str:
    """The launcher's checks before workers start (sizes; the layout's strategies against what the model's
    family supports; the weight files against the config's model, hf_weights.py), so a refusal comes
    before any worker starts; returns the model class name."""
    check_seq_len(path, seq_len)
    model = _meta_model(path, attention)
    if parallel is not None:
        check_family_supports(model, parallel, seq_len)
    check_hf_weights(path, model)
    return type(model).__name__


def resolve_attention(path: Path, attention: str = "auto") -> str:
    """The attention implementation PATH's model is built with: `attention` (auto, sdpa, eager) checked
    against its class, `auto` resolved (sdpa where `_supports_sdpa`, else eager)."""
    require_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = hf_model_type(path)
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    model_class = None if config_class is None else MODEL_FOR_CAUSAL_LM_MAPPING.get(config_class, None)
    if model_class is None:
        raise UserError(f"--model hf:{path}: model_type {model_type!r} has no causal LM class in transformers")
    sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if attention == "auto":
        return "sdpa" if sdpa else "eager"
    if attention == "sdpa" and not sdpa:
        raise UserError(f"model.attention='sdpa': {model_class.__name__} does not support it (its class sets "
                        "_supports_sdpa = False): use model.attention=auto or eager")
    return attention


def _build_options(path: Path, attention: str) -> dict[str, Any]:
    """How every rank builds PATH's model: fp32, the attention implementation `attention` resolves to."""
    return {"dtype": torch.float32, "attn_implementation": resolve_attention(path, attention)}


def _meta_model(path: Path, attention: str = "auto") -> torch.nn.Module:
    """The HF model of PATH built on the meta device (no memory, no init) with the options workers build
    it with (fp32, its attention implementation); a one-line error if it cannot be. transformers' warnings
    about the config are left to the workers, which build the same model: the launcher's checks end in one line."""
    transformers = require_transformers()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        config = _auto_config(path)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, **_build_options(path, attention))
    except (ValueError, KeyError) as e:
        raise UserError(f"--model hf:{path}: not a causal LM transformers can build ({' '.join(str(e).split())[:160]})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_family_supports(model: torch.nn.Module, parallel: ParallelConfig, seq_len: int | None = None) -> None:
    """tp needs a tensor-parallel plan (declared by the family's config, or hand-written), pp and cp the
    family's structure (its declared pipeline plan, or a hand-written record), pp parameters only in the
    plan's parts, cp an attention ring attention can replace in every layer (checked on the meta-device
    `model` over `seq_len` tokens; without one, over 2·cp tokens: sliding windows then pass): refused in one
    line naming the axis and why. pp is cut by parameters only."""
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
    if family is not None and parallel.pp > 1 and (refusal := pipeline_refusal(model, family)) is not None:
        raise UserError(f"--pp {parallel.pp}: {refusal}")
    if family is not None and parallel.cp > 1:
        check_context_attention(model, parallel.cp, seq_len or 2 * parallel.cp)
    if parallel.pp > 1 and parallel.pp_balance == "measured":  # the launcher's layout dry run cuts by parameters
        raise UserError("pipeline balance 'measured' is not supported for Hugging Face models: use 'params'")


def hf_model_type(path: Path) -> str:
    """config.json's model_type (llama, qwen2, gpt2, ...)."""
    return str(read_hf_config(path)["model_type"])


def parameter_count(path: Path) -> int:
    """Ψ of the HF model, from a construction on the meta device (no memory, no init)."""
    return sum(p.numel() for p in _meta_model(path).parameters())


def build_hf_model(path: Path, seed: int, attention: str = "auto") -> torch.nn.Module:
    """The `CausalLM` of PATH: its weights when present, else seeded init (identical on every rank), with
    the attention implementation `attention` resolves to; transformers refusing to build it is a UserError."""
    transformers = require_transformers()
    options = _build_options(path, attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            if weight_files(path):  # refuses a folder whose only weights are pickled
                model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **options)
            else:
                model = transformers.AutoModelForCausalLM.from_config(_auto_config(path), **options)
        except ValueError as e:
            raise UserError(f"--model hf:{path}: transformers cannot build it ({' '.join(str(e).split())[:160]})") from e
    return CausalLM(model)


def build_meta_hf_model(path: Path, attention: str = "auto") -> torch.nn.Module:
    """The `CausalLM` of PATH on the meta device: the structure and shapes workers build, no memory, no weights read."""
    return CausalLM(_meta_model(path, attention))
