"""What each tensor-parallel style does to the one module or parameter a plan gives it: checked, then built.

The styles (their communication costs are in tensor.py, vocab.py and moe.py):
- column styles, on an `nn.Linear` or a transposed `Conv1D` → `ColumnParallelLinear`, the input
  communicated once by the parent block (`InputOp`): `colwise` (the output split by features),
  `qkv_colwise` (a fused [q | k | v] output: each third split alike, so a rank holds the same heads'
  q, k and v: GPT-2's `c_attn`), `packed_colwise` (a packed [gate | up] output, each half split
  alike), `colwise_gather_output` (split, then gathered back to the whole output on every rank:
  Phi-3's fused `qkv_proj`, OLMo2's q/k/v whose norms span all heads).
- row styles → `RowParallelLinear`: `rowwise` (consumes a column-split output) and
  `rowwise_split_input` (takes the whole input and keeps its slice: after `colwise_gather_output`).
- `vocab`: an embedding table (plain, or scaled by `embed_scale`) → `VocabParallelEmbedding`; an
  output head → a `ColumnParallelLinear` over the vocabulary padded to a multiple of tp.
- `moe_tp_experts` on an experts module, with `packed_colwise` / `rowwise` on its 3-D expert
  parameters (moe.py).
- `replicate_grad_sum`: kept whole, its gradient summed over tp (transformers'
  `replicated_with_grad_allreduce`: Qwen3's per-head q_norm/k_norm see this rank's heads only).
- `replicate`: kept whole.
Every refusal is one line starting with the axis (`--tp N: ...`). Nothing here communicates.
"""

from __future__ import annotations

from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.errors import UserError
from ndtrain.parallel.model.moe import EXPERT_STYLES, check_expert_parameter
from ndtrain.parallel.model.tensor import ColumnParallelLinear, RowParallelLinear, linear_parts
from ndtrain.parallel.model.vocab import VocabParallelEmbedding, embedding_scale, padded_vocab

COLUMN_BLOCKS = {"colwise": 1, "qkv_colwise": 3, "packed_colwise": 2, "colwise_gather_output": 1}
ROW_SPLITS_INPUT = {"rowwise": False, "rowwise_split_input": True}
HEAD_STYLES = ("colwise", "qkv_colwise")  # styles that split an attention's projections per head


def check_module(name: str, module: nn.Module, style: str, tp: int) -> None:
    """UserError unless `style` can split `module` (named `name`) over `tp` ranks."""
    kind = type(module).__name__
    if style in COLUMN_BLOCKS or style in ROW_SPLITS_INPUT:
        parts = linear_parts(module)
        if parts is None:
            raise UserError(f"--tp {tp}: tp plan: module {name!r} is a {kind}, but {style} applies to "
                            "nn.Linear (or transformers' Conv1D) only")
        _, in_features, out_features = parts
        if style in COLUMN_BLOCKS:
            blocks = COLUMN_BLOCKS[style]
            if out_features % (blocks * tp):
                what = f"{out_features} output features" if blocks == 1 else \
                    f"{blocks} packed projections of {out_features // blocks} output features"
                raise UserError(f"--tp {tp}: tp plan: {name!r} has {what}, not divisible by tp={tp}: "
                                "change tp or the model")
            if "." not in name:
                raise UserError(f"--tp {tp}: tp plan: {style} {name!r} needs a parent block to communicate its "
                                "input: nest it in a submodule")
        elif in_features % tp:
            raise UserError(f"--tp {tp}: tp plan: {name!r} has {in_features} input features, not divisible by "
                            f"tp={tp}: change tp or the model")
    elif style == "vocab":
        if isinstance(module, nn.Embedding):
            try:
                embedding_scale(module)
            except UserError as e:
                raise UserError(f"--tp {tp}: tp plan: vocab {name!r}: {e}") from None
        elif type(module) is not nn.Linear:
            raise UserError(f"--tp {tp}: tp plan: module {name!r} is a {kind}, but vocab applies to nn.Embedding "
                            "or nn.Linear only")
    elif style == "moe_tp_experts" and not any(p.ndim >= 2 for p in module.parameters(recurse=False)):
        raise UserError(f"--tp {tp}: tp plan: module {name!r} is a {kind} without expert weights of its own, "
                        "but moe_tp_experts applies to a module holding them")


def check_parameter(name: str, param: nn.Parameter, style: str, owner_style: str | None, tp: int) -> None:
    """UserError unless `style` can split the expert parameter `name` whose module has `owner_style`."""
    if style not in EXPERT_STYLES:
        raise UserError(f"--tp {tp}: tp plan names parameter {name!r} with style {style}: a parameter may be "
                        f"{' or '.join(EXPERT_STYLES)} (an expert weight), other styles name modules")
    if owner_style != "moe_tp_experts":
        raise UserError(f"--tp {tp}: tp plan splits parameter {name!r} ({style}) but its module is not "
                        "moe_tp_experts: nothing would sum its partial outputs")
    check_expert_parameter(name, param, style, tp)


def check_experts_complete(module_name: str, module: nn.Module, styles: dict[str, str], tp: int) -> None:
    """UserError unless every expert weight of a `moe_tp_experts` module is split by the plan."""
    whole = [p for p, v in module.named_parameters(recurse=False) if v.ndim >= 2 and f"{module_name}.{p}" not in styles]
    if whole:
        raise UserError(f"--tp {tp}: tp plan makes {module_name!r} moe_tp_experts but leaves its {', '.join(whole)} "
                        f"whole: give it {' or '.join(EXPERT_STYLES)}")


def column_or_row(module: nn.Module, style: str, comm: Communicator, group: Group, sequence_parallel: bool) -> nn.Module:
    """The parallel layer replacing a linear `module` of a column or row style (its input or output
    communicated as the style says; a column layer's input by its parent's `InputOp`)."""
    if style in ROW_SPLITS_INPUT:
        return RowParallelLinear(module, comm, group, sequence_parallel=sequence_parallel,
                                 split_input=ROW_SPLITS_INPUT[style])
    return ColumnParallelLinear(module, comm, group, sequence_parallel=sequence_parallel, communicate_input=False,
                                gather_output=style == "colwise_gather_output", blocks=COLUMN_BLOCKS[style])


def vocab_parallel(module: nn.Module, comm: Communicator, group: Group, sequence_parallel: bool) -> nn.Module:
    """An embedding table or an output head split by vocabulary rows (padded to a multiple of tp)."""
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, comm, group, sequence_parallel=sequence_parallel)
    return ColumnParallelLinear(module, comm, group, sequence_parallel=sequence_parallel,
                                out_padded=padded_vocab(module.out_features, group.size))
