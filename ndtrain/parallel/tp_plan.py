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
exactly the unsharded weights), and for a `Llama` (plan=None: `LLAMA_PLAN`) also fits its seams:
query heads split over tp (n must divide n_heads), kv heads split when n divides n_kv_heads and
otherwise replicated (`ReplicatedHeadsLinear`, when n_kv_heads divides n), a tied embedding and
head keep sharing one shard, `loss_fn` becomes the vocab-parallel cross-entropy and `head` returns
full-vocabulary logits when called without targets. No collective is issued by `parallelize`.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.models.llama import Attention, Llama
from ndtrain.parallel.tensor import (
    ColumnParallelLinear, GatherLastDim, InputOp, ReplicatedHeadsLinear, RowParallelLinear, is_tensor_parallel,
    sum_gradient_over,
)
from ndtrain.parallel.vocab import VocabParallelEmbedding, padded_vocab, vocab_parallel_cross_entropy

STYLES = ("colwise", "rowwise", "vocab", "replicate")

LLAMA_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.attention_norm": "replicate",
    "layers.*.ffn_norm": "replicate",
    "norm": "replicate",
    "output": "vocab",
}

__all__ = ["LLAMA_PLAN", "STYLES", "is_tensor_parallel", "parallelize", "resolve_plan"]


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


def _check_heads(cfg: Any, tp: int) -> None:
    if cfg.n_heads % tp:
        raise UserError(f"model.n_heads={cfg.n_heads} is not divisible by tp={tp}: attention is split by heads")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise UserError(
            f"model.n_kv_heads={cfg.n_kv_heads} neither divides nor is divisible by tp={tp}: "
            "choose tp a multiple or a divisor of the kv heads")


def _kv_rows(attention: Attention, cfg: Any, tp: int, rank: int) -> tuple[int, int] | None:
    """Rows of wk/wv this rank reads when the kv heads are replicated (None when they are split)."""
    if cfg.n_kv_heads % tp == 0:
        return None
    group = cfg.n_heads // cfg.n_kv_heads  # query heads per kv head; a rank's H/tp query heads lie in one group
    kv = rank * (cfg.n_heads // tp) // group
    return kv * attention.head_dim, (kv + 1) * attention.head_dim


def parallelize(
    model: nn.Module, ctx: ParallelContext, plan: Mapping[str, str] | None = None, *, sequence_parallel: bool = False,
) -> nn.Module:
    """Split `model` (built whole, e.g. from a seed) over `ctx.group("tp")` in place and return it."""
    group, comm = ctx.group("tp"), ctx.comm
    is_llama = isinstance(model, Llama)
    if plan is None:
        if not is_llama:
            raise UserError(f"no built-in tp plan for {type(model).__name__}: pass a plan (module pattern → style)")
        plan = LLAMA_PLAN
    styles = resolve_plan(model, plan, group.size)
    if is_llama:
        _check_heads(model.cfg, group.size)
    modules = dict(model.named_modules())
    if sequence_parallel and not any(
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
            rows = _kv_rows(parent, model.cfg, group.size, group.rank) if (
                is_llama and isinstance(parent, Attention) and child in ("wk", "wv")) else None
            if rows is not None:
                new = ReplicatedHeadsLinear(module, comm, group, *rows)
            else:
                new = ColumnParallelLinear(module, comm, group, sequence_parallel=sequence_parallel,
                                           communicate_input=False)
            if parent_name not in hooked_parents:
                parent.register_forward_pre_hook(InputOp(comm, group, sequence_parallel))
                hooked_parents.add(parent_name)
        elif isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding(module, comm, group, sequence_parallel=sequence_parallel)
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
        for param in model.parameters():
            if not is_tensor_parallel(param) and id(param) not in summed:
                sum_gradient_over(param, comm, group)
    if is_llama:
        _fit_llama_seams(model, ctx)
    return model


def _fit_llama_seams(model: Llama, ctx: ParallelContext) -> None:
    output = model.output
    if not isinstance(output, ColumnParallelLinear):
        raise UserError("tp plan for Llama must make 'output' vocab-parallel (the loss is computed on vocab shards)")
    model.loss_fn = functools.partial(  # type: ignore[method-assign]
        vocab_parallel_cross_entropy, start=output.out_start, vocab_size=output.out_features,
        comm=ctx.comm, group=ctx.group("tp"))
    model.head = functools.partial(_llama_head, model, ctx)  # type: ignore[method-assign]


def _llama_head(model: Llama, ctx: ParallelContext, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """`Llama.head` on vocab shards: the loss, or (no targets) the logits gathered to the real vocabulary."""
    logits = model.output(model.norm(x))
    if targets is not None:
        return model.loss_fn(logits, targets)
    full = GatherLastDim.apply(logits, ctx.comm, ctx.group("tp"))
    return full[..., : model.output.out_features]
