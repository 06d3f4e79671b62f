"""The closed sets of values an option takes, each defined once as a `Literal` type.

Everything that checks or lists these values reads them from here:
- config validation: a config field annotated with one of these types is checked against its
  values (`checks.check_choices`), with one line naming the key and the allowed values;
- the command line: a flag's argparse `choices` are the values of the annotation of the config key
  it sets (`train.allowed_values`, `cli/flags.py`'s `value_options`), and `ndtrain plan` uses the tuples below;
- the strategies: the pipeline schedules (`parallel/pipeline/schedules.py`), recompute modes
  (`parallel/model/recompute.py`), pipeline balance (`parallel/pipeline/partition.py`) and tensor-parallel
  styles (`parallel/model/tp_plan.py`); the data formats (`data/sources.py`); the planner's layouts.
- the docs: tests/test_cli_conventions.py checks the README's `ndtrain train` usage line against them.
Open-ended keys are not here: `parallel.fsdp_wrap` ("auto" or module patterns), `data.tokenizer`
("bytes" or hf:PATH), `model.preset` (a preset name or hf:PATH, checked by `cli/flags.py`'s `parse_model`).

`values(T)` is a type's values as a tuple, in the order the help lists them (the same tuple object
on every call, so `choices` can be compared by identity).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

Backend = Literal["auto", "gloo", "nccl", "mpi"]
Device = Literal["auto", "cpu", "cuda"]
CommDtype = Literal["fp32", "bf16"]  # dtype of gradient reductions
Precision = Literal["fp32", "bf16", "fp16"]  # compute dtype (fp32 master weights in every mode)
RecomputeMode = Literal["none", "selective", "full"]
PipelineSchedule = Literal["naive", "gpipe", "1f1b", "interleaved", "zb"]
PipelineBalance = Literal["params", "measured"]
DpMode = Literal["ddp", "single-process"]
ZeroStage = Literal[0, 1, 2, 3]
PsMode = Literal["sync", "async", "ssp"]
ProgressMode = Literal["auto", "bar", "lines", "off"]
DataFormat = Literal["auto", "text", "jsonl", "parquet", "disk", "csv", "json", "arrow"]
DataKind = Literal["auto", "text", "chat", "instruction", "completion"]  # what a record is (data/sft.py)
LossOn = Literal["assistant", "completion", "all"]  # the tokens a fine-tuning example trains on (data/sft.py)
Overlong = Literal["truncate", "drop"]  # an example longer than data.max_length (data/token_file.py)
TpStyle = Literal["colwise", "rowwise", "vocab", "replicate", "colwise_gather_output", "rowwise_split_input",
                  "qkv_colwise", "packed_colwise", "moe_tp_experts", "replicate_grad_sum"]
LrScaling = Literal["none", "linear", "sqrt"]  # optim.lr relative to optim.reference_batch
OptimName = Literal["adamw", "sgd", "adafactor"]  # optim.name: the torch.optim class (run/optimizers.py)
LrScheduler = Literal["cosine", "linear", "constant", "wsd"]  # schedule.lr_scheduler after warmup (run/optimizers.py)
DigitsNet = Literal["cnn", "bn_cnn"]  # the digits task's model: models/digits.py, models/digits_cnn.py
Attention = Literal["auto", "sdpa", "eager"]  # an hf: model's attention implementation (models/hf.py)
LayoutMode = Literal["manual", "auto"]  # the layout flags as given, or the planner's choice (cli/layout_auto.py)


def values(option: Any) -> tuple[Any, ...]:
    """The values of a `Literal` type (`values(Precision) == ("fp32", "bf16", "fp16")`)."""
    if typing.get_origin(option) is not Literal:
        raise TypeError(f"{option!r} is not a Literal type")
    return typing.get_args(option)


def literal_in(hint: Any) -> Any | None:
    """The `Literal` type in a type hint (itself, or one member of a union such as `bool | ProgressMode`), or None."""
    if typing.get_origin(hint) is Literal:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for member in typing.get_args(hint):
            if typing.get_origin(member) is Literal:
                return member
    return None


RECOMPUTE_MODES = values(RecomputeMode)
PP_SCHEDULES = values(PipelineSchedule)
PP_BALANCES = values(PipelineBalance)
ZERO_STAGES = values(ZeroStage)
DATA_FORMATS = values(DataFormat)
TP_STYLES = values(TpStyle)
