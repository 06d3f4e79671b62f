"""Named presets and how they enter a raw config: below the TOML file and the flags, above the defaults.

- `MODEL_PRESETS`: sizes of the built-in Llama-style model.
- `TASK_PRESETS`: the tasks other than the language model (run/tasks.py), with the defaults they bring
  to any section. A preset's `schedule.warmup_steps` is its default warmup (`default_warmup_steps`),
  not a value the user gave: it is capped like the general default when the run is not longer.
- `hf:PATH`: a Hugging Face model; its sizes come from PATH/config.json, which the run layer reads
  (`ndtrain/run/config_checks.py`) before the config is built. Here its model table is taken as given.
"""

from __future__ import annotations

from typing import Any

from ndtrain.errors import UserError

HF_PREFIX = "hf:"  # `model.preset = "hf:PATH"`: a folder holding a transformers config.json
DEFAULT_PRESET = "small"
DEFAULT_WARMUP_STEPS = 30  # schedule.warmup_steps when neither the user nor a task preset gives one

# Named model sizes. `tiny` keeps tests fast, `small` is the default run (≈3 M parameters),
# `bench` (≈13 M parameters) is what `ndtrain bench` measures.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=32),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, seq_len=128),
    "bench": dict(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024, seq_len=256),
    # `ndtrain bench` at larger sizes (Ψ with the byte vocabulary of 256): 25.4 M and 101.1 M parameters
    "bench-25m": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, seq_len=256),
    "bench-100m": dict(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, ffn_dim=2048, seq_len=256),
}

# Presets of the tasks other than the language model (run/tasks.py), with the defaults they bring to any
# section (below the TOML file and flags). `digits`: the CNN of models/digits.py (model.dim is its
# embedding size; the other model keys are unused); its run reaches CMC rank-1 >= 0.95 on CPU in seconds.
TASK_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "digits": {
        "model": dict(dim=64),
        "schedule": dict(steps=150, global_batch=64, micro_batch=32, warmup_steps=10),
        "optim": dict(lr=3e-3, weight_decay=0.01),
        "data": dict(eval_samples=0),
        "log": dict(eval_every=50),
        "parallel": dict(fsdp_wrap="features,project"),  # ZeRO-3 units: the conv stack, the projection; root: classifier
    },
}
PRESET_NAMES = (*MODEL_PRESETS, *TASK_PRESETS)


def is_hf_preset(preset: Any) -> bool:
    """Whether a `model.preset` value names a Hugging Face model folder (`hf:PATH`)."""
    return isinstance(preset, str) and preset.startswith(HF_PREFIX)


def apply_presets(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a nested dict whose tables are copies) with its model preset's sizes under the explicit
    model keys and a task preset's defaults under each section's explicit keys."""
    model_raw = raw.get("model", {})
    if not isinstance(model_raw, dict):
        raise UserError("config key 'model' must be a table")
    preset = model_raw.get("preset", DEFAULT_PRESET)
    if is_hf_preset(preset):
        return raw
    if not isinstance(preset, str) or preset not in PRESET_NAMES:
        raise UserError(f"model.preset={preset!r} is unknown: choose one of {', '.join(PRESET_NAMES)} or hf:PATH")
    raw["model"] = {**MODEL_PRESETS.get(preset, {}), **model_raw, "preset": preset}
    for section, defaults in TASK_PRESETS.get(preset, {}).items():
        given = raw.get(section, {})
        if section == "schedule":  # the preset's warmup is a default: default_warmup_steps
            defaults = {k: v for k, v in defaults.items() if k != "warmup_steps"}
        raw[section] = {**defaults, **given} if isinstance(given, dict) else given
    return raw


def default_warmup_steps(preset: str) -> int:
    """The warmup of a run of `preset` that does not give schedule.warmup_steps (before any cap)."""
    return int(TASK_PRESETS.get(preset, {}).get("schedule", {}).get("warmup_steps", DEFAULT_WARMUP_STEPS))
