"""The tensor-parallel plan: which module of a model is split how, validated, then applied in place.

A plan maps module-name patterns (fnmatch, as `parallel.fsdp_wrap`: `layers.*.attention.wq`) to a
style (tp_styles.py says what each does, tensor.py / vocab.py / moe.py what each communicates):
- `colwise` (an `nn.Linear` or `Conv1D`): split by output features → `ColumnParallelLinear`. Its
  input is communicated (f, or the sequence all-gather) once by a forward pre-hook on its parent
  block, shared with its column siblings: the parent must be a submodule passing its first input
  only to them (Megatron's attention and MLP blocks). Likewise `qkv_colwise` (fused q|k|v, split
  per third), `packed_colwise` (packed gate|up, split per half) and `colwise_gather_output` (the
  whole output gathered back on every rank).
- `rowwise`: split by input features → `RowParallelLinear` (all-reduce or reduce-scatter of the
  output). It must consume a column-split output; `rowwise_split_input` takes a whole one.
- `vocab`: an `nn.Embedding` → `VocabParallelEmbedding`; an `nn.Linear` (an output head) → a
  `ColumnParallelLinear` over the vocabulary padded to a multiple of tp, communicating its own
  input; the loss must then be `vocab_parallel_cross_entropy`.
- `moe_tp_experts` (an experts module) with `packed_colwise` / `rowwise` naming its 3-D expert
  parameters: a pattern that matches no module may match parameters.
- `replicate_grad_sum`: kept whole, its gradient summed over tp by a hook (per-head norms).
- `replicate`: kept whole on every rank (norms), as is every module no pattern names.
Replicated parameters whose gradient is partial on each rank get a hook summing it over tp:
- with sequence parallelism the residual stream between blocks is a sequence shard [B, T/n, d]
  (the vocab embedding reduce-scatters, row layers reduce-scatter), so every replicated parameter
  that sees it (norms, a row layer's bias) sees only its rank's tokens;
- inside a block whose column layers split their output (the parent of colwise children), a
  replicated parameter the plan does not name works on this rank's features only (a learned
  activation's parameters: Apertus' xIELU), with or without sequence parallelism;
- inside a block whose column layers all gather their output (`colwise_gather_output`: OLMo2's
  q_norm over the gathered q) every rank computes the same whole result: no hook.

`parallelize(model, ctx, plan)` slices the weights of the *full* model (so a tp run starts from
exactly the unsharded weights). What is specific to a model comes from its spec
(`parallel.model_spec.parallel_spec`; no model is imported here): its shipped plan (plan=None;
the built-in Llama's in models/llama_parallel.py, a Hugging Face family's in models/hf_parallel.py),
its attention `Heads` (used when the plan splits an attention's projections per head: query heads
split over tp, n must divide them; kv heads split when n divides them and otherwise replicated,
`ReplicatedHeadsLinear`, when they divide n), where sequence parallelism cuts the sequence when the
embedding cannot (`SequenceCut`: the first decoder layer's input is cut to this rank's shard by
`SplitSequence`, all-gather of the gradient backward), and the seams it refits after the split
(`fit_tensor_parallel`: the vocab-parallel loss, logits gathered to the full vocabulary when called
without targets, local head counts). A tied embedding and head keep sharing one shard. No
collective is issued by `parallelize`. Every refusal is one line starting `--tp N:`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.model_spec import Heads, SequenceCut, parallel_spec
from ndtrain.config.options import TP_STYLES as STYLES
from ndtrain.parallel.placement import is_tensor_parallel
from ndtrain.parallel.model.lora import LoRA
from ndtrain.parallel.model.moe import parallelize_experts, split_expert_parameter
from ndtrain.parallel.model.tensor import (
    ColumnParallelLinear, InputOp, ReplicatedHeadsLinear, RowParallelLinear, SplitSequence, sum_gradient_over,
)
from ndtrain.parallel.model.tp_styles import (
    COLUMN_BLOCKS, HEAD_STYLES, check_experts_complete, check_module, check_parameter, column_or_row, vocab_parallel,
)

__all__ = ["STYLES", "default_plan", "is_tensor_parallel", "parallelize", "resolve_plan"]


def resolve_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, str]:
    """Module (or expert parameter) name → style for everything the plan names, checked against the
    model and `tp`. A pattern names modules; one matching no module may name parameters."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UserError(f"--tp {tp}: tp plan {pattern!r}: unknown style {style!r}, choose one of {', '.join(STYLES)}")
        matched = ([name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
                   or [name for name in params if fnmatch.fnmatchcase(name, pattern)])
        if not matched:
            raise UserError(f"--tp {tp}: tp plan pattern {pattern!r} matches no module (or parameter) of "
                            f"{type(model).__name__}: fix or remove it")
        for name in matched:
            if styles.get(name, style) != style:
                raise UserError(f"--tp {tp}: tp plan gives {name!r} two styles, {styles[name]} and {style}: keep one")
            styles[name] = style
    for name, style in styles.items():
        if name in modules:
            check_module(name, modules[name], style, tp)
            if style == "moe_tp_experts":
                check_experts_complete(name, modules[name], styles, tp)
        else:
            check_parameter(name, params[name], style, styles.get(name.rpartition(".")[0]), tp)
    return styles


def _check_heads(heads: Heads, tp: int) -> None:
    q_key, kv_key = heads.keys
    if heads.n_heads % tp:
        raise UserError(f"--tp {tp}: {q_key}={heads.n_heads} is not divisible by tp={tp}: attention is split by heads")
    if heads.n_kv_heads % tp and tp % heads.n_kv_heads:
        raise UserError(
            f"--tp {tp}: {kv_key}={heads.n_kv_heads} neither divides nor is divisible by tp={tp}: "
            "choose tp a multiple or a divisor of the kv heads")


def _check_per_head_parameters(heads: Heads, styles: dict[str, str], modules: dict[str, nn.Module], tp: int) -> None:
    """A split attention computes this rank's heads only: a 1-D parameter of it holding one value per
    (kv) head that the plan keeps whole (Doge's `A`) would meet tensors of 1/tp of the heads."""
    for name, module in modules.items():
        if not isinstance(module, heads.attention_type):
            continue
        for child, param in module.named_parameters(recurse=False):
            per_head = param.ndim == 1 and param.shape[0] in (heads.n_heads, heads.n_kv_heads)
            if per_head and param.shape[0] != heads.head_dim and f"{name}.{child}" not in styles:
                raise UserError(f"--tp {tp}: {name}.{child} holds one value per attention head (shape "
                                f"{list(param.shape)}) and the tp plan does not split it: this family's attention "
                                "cannot be split by heads; use dp/ZeRO, pp or cp")


def _split_heads(heads: Heads | None, styles: dict[str, str], modules: dict[str, nn.Module]) -> Heads | None:
    """`heads` when the plan splits some attention's projections per head, else None (nothing to count)."""
    if heads is None:
        return None
    split = any(style in HEAD_STYLES and name in modules and isinstance(modules[name.rpartition(".")[0]],
                                                                         heads.attention_type)
                for name, style in styles.items())
    return heads if split else None


def _kv_rows(heads: Heads, tp: int, rank: int) -> tuple[int, int] | None:
    """Rows of wk/wv this rank reads when the kv heads are replicated (None when they are split)."""
    if heads.n_kv_heads % tp == 0:
        return None
    group = heads.n_heads // heads.n_kv_heads  # query heads per kv head; a rank's H/tp query heads lie in one group
    kv = rank * (heads.n_heads // tp) // group
    return kv * heads.head_dim, (kv + 1) * heads.head_dim


def default_plan(model: nn.Module) -> Mapping[str, str]:
    """The plan shipped with `model` (its spec's), or one line saying why there is none."""
    spec = parallel_spec(model)
    plan = spec.tp_plan() if spec is not None else None
    if plan is not None:
        return plan
    what = spec.name if spec is not None else type(model).__name__
    raise UserError(
        f"tensor parallel needs a plan, and there is no built-in tp plan for {what}: pass a plan, "
        "Engine(..., tp_plan={module pattern: style}) "
        f"with styles {', '.join(STYLES)}")


def parallelize(
    model: nn.Module, ctx: ParallelContext, plan: Mapping[str, str] | None = None, *, sequence_parallel: bool = False,
) -> nn.Module:
    """Split `model` (built whole, e.g. from a seed) over `ctx.group("tp")` in place and return it."""
    group, comm = ctx.group("tp"), ctx.comm
    spec = parallel_spec(model)
    if spec is not None:
        spec.check_tensor_parallel()
    styles = resolve_plan(model, default_plan(model) if plan is None else plan, group.size)
    modules = dict(model.named_modules())
    heads = _split_heads(spec.heads() if spec is not None else None, styles, modules)
    if heads is not None:
        _check_heads(heads, group.size)
        _check_per_head_parameters(heads, styles, modules, group.size)
    cut = spec.sequence_cut() if sequence_parallel and spec is not None else None  # None: the embedding cuts
    if sequence_parallel and cut is None and not any(
        style == "vocab" and isinstance(modules.get(name), nn.Embedding) for name, style in styles.items()
    ):
        raise UserError(f"--tp {group.size}: sequence_parallel needs a vocab-parallel embedding to split the "
                        "sequence: add one to the plan")
    shared: dict[int, nn.Parameter] = {}  # id of a full parameter → its shard, so tied weights stay tied
    hooked_parents: set[str] = set()
    replaced: dict[str, nn.Module] = {}
    summed: set[int] = set()  # parameters whose gradient a hook of their own completes
    for name, style in styles.items():
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        if style == "replicate":
            continue
        if name not in modules:  # an expert parameter
            split_expert_parameter(parent, child, style, group)
            continue
        module = modules[name]
        if style == "replicate_grad_sum":
            for param in module.parameters():
                sum_gradient_over(param, comm, group)
                summed.add(id(param))
            continue
        if style == "moe_tp_experts":
            parallelize_experts(module, comm, group, sequence_parallel)
            continue
        if style == "vocab":
            embedding = isinstance(module, nn.Embedding)  # it reduce-scatters unless the spec cuts the sequence
            new = vocab_parallel(module, comm, group, sequence_parallel and not (embedding and cut is not None))
        else:
            rows = _kv_rows(heads, group.size, group.rank) if (
                style == "colwise" and heads is not None and isinstance(parent, heads.attention_type)
                and child in heads.kv_names) else None
            new = ReplicatedHeadsLinear(module, comm, group, *rows) if rows is not None else column_or_row(
                module, style, comm, group, sequence_parallel)
            if style in COLUMN_BLOCKS and parent_name not in hooked_parents:
                parent.register_forward_pre_hook(InputOp(comm, group, sequence_parallel), with_kwargs=True)
                hooked_parents.add(parent_name)
        full_weight = module.weight
        if id(full_weight) in shared:
            new.weight = shared[id(full_weight)]
        shared[id(full_weight)] = new.weight
        replaced[name] = new
    for name, new in replaced.items():
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, new)
    _sum_partial_gradients(model, ctx, sequence_parallel, cut, summed, hooked_parents)
    if spec is not None:
        spec.fit_tensor_parallel(ctx, heads)
    return model


def _sum_partial_gradients(
    model: nn.Module, ctx: ParallelContext, sequence_parallel: bool, cut: SequenceCut | None, summed: set[int],
    hooked_parents: set[str],
) -> None:
    """A gradient hook summing over tp every replicated parameter whose gradient is partial on each rank
    (see the module docstring; `summed`: those with a hook already); installs the sequence cut."""
    comm, group = ctx.comm, ctx.group("tp")
    complete = set(summed) | {id(m.weight) for m in model.modules() if isinstance(m, ReplicatedHeadsLinear)}
    complete |= {id(p) for m in model.modules() if isinstance(m, LoRA) for p in m.parameters()}  # split_adapter's hook
    partial: set[int] = set()
    if cut is not None:  # parameters before the cut see the whole sequence: their gradient is complete
        complete |= {id(p) for name in cut.before for p in model.get_submodule(name).parameters()}
        model.get_submodule(cut.at).register_forward_pre_hook(
            InputOp(comm, group, True, cut.input_name, op=SplitSequence), with_kwargs=True)
    for parent_name in hooked_parents:
        parent = model.get_submodule(parent_name)
        gathered = all(m.gather_output for m in parent.modules() if isinstance(m, ColumnParallelLinear))
        for module in parent.modules():
            if isinstance(module, RowParallelLinear):
                continue  # its bias is added to the reduced output: the residual stream's rule
            for param in module.parameters(recurse=False):
                if not is_tensor_parallel(param) and id(param) not in complete:
                    (complete if gathered else partial).add(id(param))
    for param in model.parameters():
        if not is_tensor_parallel(param) and id(param) not in complete and (sequence_parallel or id(param) in partial):
            sum_gradient_over(param, comm, group)
