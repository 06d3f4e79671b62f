"""Typed run configuration: dataclasses, loaded from TOML and overridden from the command line.

What lives here, one responsibility a file:
- options.py: the closed sets of values an option takes, each a `Literal` type;
- checks.py: the value checks the sections share (positive, existing path, allowed value, vocabulary);
- presets.py: the model and task presets and how they enter a raw config (`hf:PATH` is taken as given);
- sections.py: the model, data, optim, schedule, checkpoint, log and launch sections;
- parallel.py: the layout sections, parallel and ps;
- train.py: `TrainConfig` (every section, the checks across them) and `allowed_values`;
- loading.py: TOML in (tomllib) and out (tomli-w), `--set key=value`, typed building, `load_config`.

This package imports only `ndtrain.errors`, the standard library, tomllib (tomli on Python 3.10) and
tomli-w: every layer may import it. What a config names outside itself (an `hf:PATH` model, an `hf:`
tokenizer, the trackers of `log.report_to`) is read and checked by the run layer, which owns both
sides: `ndtrain.run.config_checks.resolve_config` is the config a run uses.
"""

from ndtrain.config.checks import check_vocab_size
from ndtrain.config.loading import config_from_dict, dump_toml, load_config, parse_override, raw_config, read_toml
from ndtrain.config.parallel import ParallelConfig, PSConfig
from ndtrain.config.presets import HF_PREFIX, MODEL_PRESETS, PRESET_NAMES, TASK_PRESETS, is_hf_preset
from ndtrain.config.sections import (
    CheckpointConfig, DataConfig, LaunchConfig, LogConfig, LoRAConfig, ModelConfig, OptimConfig, ScheduleConfig,
)
from ndtrain.config.train import BYTE_VOCAB, TrainConfig, allowed_values

__all__ = [
    "BYTE_VOCAB", "HF_PREFIX", "MODEL_PRESETS", "PRESET_NAMES", "TASK_PRESETS", "CheckpointConfig", "DataConfig",
    "LaunchConfig", "LogConfig", "LoRAConfig", "ModelConfig", "OptimConfig", "PSConfig", "ParallelConfig", "ScheduleConfig",
    "TrainConfig", "allowed_values", "check_vocab_size", "config_from_dict", "dump_toml", "is_hf_preset",
    "load_config", "parse_override", "raw_config", "read_toml",
]
