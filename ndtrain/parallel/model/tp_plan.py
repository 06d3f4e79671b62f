"""The tensor-parallel plan: which module of a model is split how, validated, then applied in place.

A plan maps module-name patterns (fnmatch, as `parallel.fsdp_wrap`: `layers.*.attention.wq`) to a
style:
- `colwise` (an `nn.Linear`): split by output features → `ColumnParallelLinear`. Its input is
  communicated (f, or the sequence all-gather) once by a forward pre-hook on its parent block,
  shared with its colwise siblings: the parent must be a submodule passing its first input only
  to them (Megatron's attention and MLP blocks).
- `rowwise` (an `nn.Linear`): split by input features → `RowParallelLinear` (all-reduce or
  reduce-scatter of the output). It must consume a colwise output.
- `vocab`: an `nn.Embedding` → `VocabParallelEmbedding`; an `nn.Linear` (an output head) → a
  `ColumnParallelLinear` over the vocabulary padded to a multiple of tp, communicating its own
  input; the loss must then be `vocab_parallel_cross_entropy`.
- `replicate`: kept whole on every rank (norms), as is every module no pattern names.
With sequence parallelism the residual stream between blocks is a sequence shard [B, T/n, d]
(the vocab embedding reduce-scatters, rowwise layers reduce-scatter), so every replicated
parameter sees only its rank's tokens: its gradient is summed over tp by a hook.

`parallelize(model, ctx, plan)` slices the weights of the *full* model (so a tp run starts from
exactly the unsharded weights). What is specific to a model comes from its spec
(`parallel.model_spec.parallel_spec`; no model is imported here): its shipped plan (plan=None;
the built-in Llama's in models/llama_parallel.py, a Hugging Face family's in models/hf_parallel.py),
its attention `Heads` (query heads split over tp, n must divide them; kv heads split when n divides
them and otherwise replicated, `ReplicatedHeadsLinear`, when they divide n), where sequence
parallelism cuts the sequence when the embedding cannot (`SequenceCut`: the first decoder layer's
input is cut to this rank's shard by `SplitSequence`, all-gather of the gradient backward), and the
seams it refits after the split (`fit_tensor_parallel`: the vocab-parallel loss, logits gathered
to the full vocabulary when called without targets). A tied embedding and head keep sharing one
shard. No collective is issued by `parallelize`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.model_spec import Heads, parallel_spec
from ndtrain.config.options import TP_STYLES as STYLES
from ndtrain.parallel.placement import is_tensor_parallel
from ndtrain.parallel.model.tensor import (
    ColumnParallelLinear, InputOp, ReplicatedHeadsLinear, RowParallelLinear, SplitSequence,
    sum_gradient_over,
)
from ndtrain.parallel.model.vocab import VocabParallelEmbedding, padded_vocab

__all__ = ["STYLES", "default_plan", "is_tensor_parallel", "parallelize", "resolve_plan"]


def resolve_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, str]:
    """Module name → style for every module the plan names, checked against the model and `tp`."""
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UserError(f"tp plan {pattern!r}: unknown style {style!r}, choose one of {', '.join(STYLES)}")
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise UserError(
                f"tp plan pattern {pattern!r} matches no module of {type(model).__name__}: fix or remove it")
        for name in matched:
            if styles.get(name, style) != style:
                raise UserError(f"tp plan gives module {name!r} two styles, {styles[name]} and {style}: keep one")
            styles[name] = style
    for name, style in styles.items():
        _check_module(name, modules[name], style, tp)
    return styles


def _check_module(name: str, module: nn.Module, style: str, tp: int) -> None:
    kind = type(module).__name__
    if style in ("colwise", "rowwise") and type(module) is not nn.Linear:
        raise UserError(f"tp plan: module {name!r} is a {kind}, but {style} applies to nn.Linear only")
    if style == "vocab" and type(module) not in (nn.Linear, nn.Embedding):
        raise UserError(f"tp plan: module {name!r} is a {kind}, but vocab applies to nn.Embedding or nn.Linear only")
    for split, features, what in (("colwise", "out_features", "output"), ("rowwise", "in_features", "input")):
        size = getattr(module, features, 0)
        if style == split and size % tp:
            raise UserError(
                f"tp plan: {name!r} has {size} {what} features, not divisible by tp={tp}: change tp or the model")
    if style == "colwise" and "." not in name:
        raise UserError(
            f"tp plan: colwise {name!r} needs a parent block to communicate its input: nest it in a submodule")


def _check_heads(heads: Heads, tp: int) -> None:
    q_key, kv_key = heads.keys
    if heads.n_heads % tp:
        raise UserError(f"{q_key}={heads.n_heads} is not divisible by tp={tp}: attention is split by heads")
    if heads.n_kv_heads % tp and tp % heads.n_kv_heads:
        raise UserError(
            f"{kv_key}={heads.n_kv_heads} neither divides nor is divisible by tp={tp}: "
            "choose tp a multiple or a divisor of the kv heads")


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
        f"no built-in tp plan for {what}: pass a plan, Engine(..., tp_plan={{module pattern: style}}) "
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
    heads = spec.heads() if spec is not None else None
    if heads is not None:
        _check_heads(heads, group.size)
    modules = dict(model.named_modules())
    cut = spec.sequence_cut() if sequence_parallel and spec is not None else None  # None: the embedding cuts
    if sequence_parallel and cut is None and not any(
        style == "vocab" and isinstance(modules[name], nn.Embedding) for name, style in styles.items()
    ):
        raise UserError("sequence_parallel needs a vocab-parallel embedding to split the sequence: add one to the plan")
    shared: dict[int, nn.Parameter] = {}  # id of a full parameter → its shard, so tied weights stay tied
    hooked_parents: set[str] = set()
    replaced: dict[str, nn.Module] = {}
    for name, style in styles.items():
        module = modules[name]
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        if style == "replicate":
            continue
        if style == "rowwise":
            new: nn.Module = RowParallelLinear(module, comm, group, sequence_parallel=sequence_parallel)
        elif style == "colwise":
            rows = _kv_rows(heads, group.size, group.rank) if (
                heads is not None and isinstance(parent, heads.attention_type) and child in heads.kv_names) else None
            if rows is not None:
                new = ReplicatedHeadsLinear(module, comm, group, *rows)
            else:
                new = ColumnParallelLinear(module, comm, group, sequence_parallel=sequence_parallel,
                                           communicate_input=False)
            if parent_name not in hooked_parents:
                parent.register_forward_pre_hook(InputOp(comm, group, sequence_parallel), with_kwargs=True)
                hooked_parents.add(parent_name)
        elif isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding(module, comm, group, sequence_parallel=sequence_parallel and cut is None)
        else:
            new = ColumnParallelLinear(module, comm, group, sequence_parallel=sequence_parallel,
                                       out_padded=padded_vocab(module.out_features, group.size))
        full_weight = module.weight
        if id(full_weight) in shared:
            new.weight = shared[id(full_weight)]
        shared[id(full_weight)] = new.weight
        replaced[name] = new
    for name, new in replaced.items():
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, new)
    if sequence_parallel:
        summed = {id(m.weight) for m in model.modules() if isinstance(m, ReplicatedHeadsLinear)}
        if cut is not None:  # parameters before the cut see the whole sequence: their gradient is complete
            summed |= {id(p) for name in cut.before for p in model.get_submodule(name).parameters()}
            model.get_submodule(cut.at).register_forward_pre_hook(
                InputOp(comm, group, True, cut.input_name, op=SplitSequence), with_kwargs=True)
        for param in model.parameters():
            if not is_tensor_parallel(param) and id(param) not in summed:
                sum_gradient_over(param, comm, group)
    if spec is not None:
        spec.fit_tensor_parallel(ctx, heads)
    return model
