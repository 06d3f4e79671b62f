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

A Hugging Face model behind the `CausalLM` adapter gets the same treatment from its family's plan
(`hf_families.FAMILIES`; plan=None uses it, a family without one is refused in one line): heads
from its config, k/v projections replicated when n does not divide the kv heads (the attention's
`num_key_value_groups` is set to the local ratio), `loss_fn` vocab-parallel, and `full_logits`
gathering the vocabulary when called without targets. HF attention is called with
`hidden_states=` by keyword, which `InputOp` reads. With sequence parallelism the embedding
all-reduces (HF computes the causal mask, positions and RoPE tables from the embedding's output,
which must therefore span the whole sequence) and the first decoder layer's input is cut to this
rank's sequence shard (`SplitSequence`; all-gather of the gradient backward); the decoder layers
and the final norm then run on shards and the vocab-parallel head gathers them. This costs one
all-reduce of b·s·d instead of the reduce-scatter the built-in model's embedding does.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.models.causal_lm import CausalLM
from ndtrain.models.hf_families import Family, decoder_layers, family_of, hf_config
from ndtrain.models.llama import Attention, Llama
from ndtrain.parallel.tensor import (
    ColumnParallelLinear, GatherLastDim, InputOp, ReplicatedHeadsLinear, RowParallelLinear, SplitSequence,
    is_tensor_parallel, sum_gradient_over,
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

__all__ = ["LLAMA_PLAN", "STYLES", "default_plan", "is_tensor_parallel", "parallelize", "resolve_plan"]


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


@dataclass(frozen=True)
class Heads:
    """The attention geometry tensor parallel splits: query/kv head counts, head size, and which
    children of which attention module class project keys and values."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    attention_type: type
    kv_names: tuple[str, ...]


def _heads(model: nn.Module, family: Family | None) -> Heads | None:
    if isinstance(model, Llama):
        cfg = model.cfg
        return Heads(cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads, Attention, ("wk", "wv"))
    if family is None:
        return None
    config = hf_config(model)
    attention = decoder_layers(model)[1][0].get_submodule(family.attention)  # type: ignore[index]
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return Heads(config.num_attention_heads, n_kv, attention.head_dim, type(attention), family.kv_projections)


def _check_heads(heads: Heads, tp: int) -> None:
    if heads.n_heads % tp:
        raise UserError(f"the model's {heads.n_heads} attention heads are not divisible by tp={tp}: attention is split by heads")
    if heads.n_kv_heads % tp and tp % heads.n_kv_heads:
        raise UserError(
            f"the model's {heads.n_kv_heads} kv heads neither divide nor are divisible by tp={tp}: "
            "choose tp a multiple or a divisor of the kv heads")


def _kv_rows(heads: Heads, tp: int, rank: int) -> tuple[int, int] | None:
    """Rows of wk/wv this rank reads when the kv heads are replicated (None when they are split)."""
    if heads.n_kv_heads % tp == 0:
        return None
    group = heads.n_heads // heads.n_kv_heads  # query heads per kv head; a rank's H/tp query heads lie in one group
    kv = rank * (heads.n_heads // tp) // group
    return kv * heads.head_dim, (kv + 1) * heads.head_dim


def default_plan(model: nn.Module) -> dict[str, str]:
    """The plan shipped for `model` (the built-in Llama, a supported HF family), or one line saying why none."""
    if isinstance(model, Llama):
        return LLAMA_PLAN
    family = family_of(model)
    if family is not None:
        if family.tp_plan is None:
            raise UserError(family.tp_refusal)
        return family.tp_plan
    config = hf_config(model)
    what = f"Hugging Face model_type {config.model_type!r}" if config is not None else type(model).__name__
    raise UserError(
        f"no built-in tp plan for {what}: pass one, Engine(..., tp_plan={{module pattern: style}}) "
        f"with styles {', '.join(STYLES)}")


def parallelize(
    model: nn.Module, ctx: ParallelContext, plan: Mapping[str, str] | None = None, *, sequence_parallel: bool = False,
) -> nn.Module:
    """Split `model` (built whole, e.g. from a seed) over `ctx.group("tp")` in place and return it."""
    group, comm = ctx.group("tp"), ctx.comm
    is_llama = isinstance(model, Llama)
    family = family_of(model)
    if family is not None and not isinstance(model, CausalLM):
        raise UserError("tensor parallel on a Hugging Face model needs the adapter: "
                        "pass ndtrain.models.causal_lm.CausalLM(model)")
    styles = resolve_plan(model, default_plan(model) if plan is None else plan, group.size)
    heads = _heads(model, family)
    if heads is not None:
        _check_heads(heads, group.size)
    modules = dict(model.named_modules())
    split_at_layers = sequence_parallel and family is not None  # HF: the sequence is cut at the first layer
    if sequence_parallel and not split_at_layers and not any(
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
            new = VocabParallelEmbedding(module, comm, group, sequence_parallel=sequence_parallel and not split_at_layers)
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
        if split_at_layers:  # parameters before the cut see the whole sequence: their gradient is complete
            summed |= {id(p) for e in family.embeddings for p in model.get_submodule(e).parameters()}  # type: ignore[union-attr]
            layers = decoder_layers(model)[1][0]  # type: ignore[index]
            layers.register_forward_pre_hook(
                InputOp(comm, group, True, family.layer_input, op=SplitSequence), with_kwargs=True)  # type: ignore[union-attr]
        for param in model.parameters():
            if not is_tensor_parallel(param) and id(param) not in summed:
                sum_gradient_over(param, comm, group)
    if is_llama:
        _fit_llama_seams(model, ctx)
    elif family is not None:
        _fit_causal_lm_seams(model, ctx, family, heads)  # type: ignore[arg-type]
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


def _fit_causal_lm_seams(model: CausalLM, ctx: ParallelContext, family: Family, heads: Heads) -> None:
    """Vocab-parallel loss and gathered logits on the adapter; local kv-group ratio on HF attention."""
    head = model.get_submodule(family.head)
    if not isinstance(head, ColumnParallelLinear):
        raise UserError(f"tp plan for {family.model_type} must make {family.head!r} vocab-parallel "
                        "(the loss is computed on vocab shards)")
    tp = ctx.group("tp").size
    local_kv = heads.n_kv_heads // tp if heads.n_kv_heads % tp == 0 else 1
    for module in model.modules():
        if isinstance(module, heads.attention_type) and hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = heads.n_heads // tp // local_kv
    model.loss_fn = functools.partial(  # type: ignore[method-assign]
        vocab_parallel_cross_entropy, start=head.out_start, vocab_size=head.out_features,
        comm=ctx.comm, group=ctx.group("tp"))
    model.full_logits = functools.partial(_gather_vocab, head, ctx)  # type: ignore[method-assign]


def _gather_vocab(head: ColumnParallelLinear, ctx: ParallelContext, logits: torch.Tensor) -> torch.Tensor:
    """Logit shards [..., V'/n] → the real vocabulary [..., V] on every tp rank."""
    return GatherLastDim.apply(logits, ctx.comm, ctx.group("tp"))[..., : head.out_features]
