"""What a model tells the parallel strategies about itself: the `ModelParallel` interface and its lookup.

Tensor parallel (`parallel/model/tp_plan.py`), the pipeline cut (`parallel/pipeline/partition.py`),
context parallel (`parallel/model/context.py`), activation recomputation (`parallel/model/recompute.py`)
and ZeRO-3's units (`parallel/data/zero3_parameters.py`) never import a model. They call
`parallel_spec(model)`, which returns
- the spec a caller bound to the model (`bind_spec`: the engine binds a bare transformers model's
  family spec, `models/hf_parallel.spec_of`);
- else what the model's own `parallel_spec()` method returns (the built-in Llama:
  `models/llama_parallel.py`; the `CausalLM` adapter: its family's spec, `models/hf_parallel.py`, which
  refuses in one line what it cannot do for a model_type ndtrain has no family for);
- else None: the strategies' generic path (a tp plan the user gives, a sequential pipeline with
  `loss_fn`, the `attend` seams for selective recomputation, `largest_block_list` for the layers).

A new model brings its plan by defining `parallel_spec(self) -> ModelParallel` (a subclass overriding
what applies to it): no strategy changes. The base class describes a model with no model-specific
knowledge; every method says what the strategy does with the answer. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ndtrain.errors import UserError

if TYPE_CHECKING:  # annotations only: the context module asks this one for a model's spec
    from ndtrain.dist.mesh import ParallelContext
    from ndtrain.parallel.model.context import Ring

_BOUND = "_ndtrain_parallel_spec"
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
Timer = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], float]  # median fwd+bwd seconds of fn(x)


@dataclass(frozen=True)
class Heads:
    """The attention geometry tensor parallel splits: query/kv head counts, head size, and which
    children of which attention module class project keys and values."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    attention_type: type
    kv_names: tuple[str, ...]
    keys: tuple[str, str] = ("model.n_heads", "model.n_kv_heads")  # the config keys a user changes


@dataclass(frozen=True)
class SequenceCut:
    """Where sequence parallelism cuts the sequence when the embedding cannot (its output must span the
    whole sequence): the input `input_name` (positional or keyword) of the module named `at` becomes
    this rank's shard; the parameters of the modules named `before` see the whole sequence, so their
    gradients are complete. Names, not modules: tensor parallel replaces modules after asking."""

    at: str
    input_name: str
    before: tuple[str, ...]


class ModelParallel:
    """One model's answers to the strategies; this base answers for a model with no specific knowledge."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def name(self) -> str:
        """The model as messages name it."""
        return type(self.model).__name__

    # tensor parallel ------------------------------------------------------------------------
    def tp_plan(self) -> Mapping[str, str] | None:
        """The shipped plan (module pattern → style); None: the user must give one. May refuse in one line."""
        return None

    def check_tensor_parallel(self) -> None:
        """Refuse (UserError) a model tensor parallel cannot split whatever the plan."""

    def heads(self) -> Heads | None:
        """The attention heads to split (None: the plan's matrices are split without head bookkeeping)."""
        return None

    def sequence_cut(self) -> SequenceCut | None:
        """Where sequence parallelism cuts the sequence; None: the vocab-parallel embedding reduce-scatters it."""
        return None

    def fit_tensor_parallel(self, ctx: ParallelContext, heads: Heads | None) -> None:
        """After the split: replace the model's seams (loss, full logits) by their vocab-parallel versions."""

    # pipeline ---------------------------------------------------------------------------------
    def pipeline_blocks(self, loss_fn: LossFn | None, balance: str) -> list[nn.Module]:
        """The blocks the cut distributes over stages, in order (after refusing what cannot be cut)."""
        raise UserError(f"pipeline parallel is not supported for {self.name}: "
                        "pass its blocks as an nn.Sequential with loss_fn")

    def end_costs(self) -> tuple[float, float]:
        """Parameter counts the first stage (embedding) and the last stage (norm, head) add to their blocks'."""
        return 0.0, 0.0

    def measured_costs(self, blocks: Sequence[nn.Module], timed: Timer) -> tuple[list[float], float, float]:
        """Seconds of each block, of the first stage's extras and of the last stage's (`balance=measured`)."""
        raise UserError(f"pipeline balance 'measured' is not supported for {self.name}: use 'params'")

    def pipeline_stage(self, block_ids: Sequence[int], first: bool, last: bool, loss_fn: LossFn | None) -> nn.Module:
        """The stage module holding `block_ids` (+ the embedding when first, norm, head and loss when last)."""
        raise UserError(f"pipeline parallel is not supported for {self.name}")

    def tied_weights(self) -> tuple[str, str] | None:
        """(embedding, head) parameter names when they share one tensor (the pipeline keeps a copy per end)."""
        return None

    # structure ---------------------------------------------------------------------------------
    def decoder_layers(self) -> tuple[str, nn.ModuleList] | None:
        """(name, list) of the blocks ZeRO-3 wraps as units and recompute checkpoints one by one."""
        return largest_block_list(self.model)

    @property
    def takes_position_ids(self) -> bool:
        """The forward takes `position_ids=` (a context-parallel shard passes its global positions)."""
        return False

    # context parallel --------------------------------------------------------------------------
    def context_parallel(self, ring: Ring) -> nn.Module | None:
        """Route the model's attention through `ring` its own way and return it; None: the `attend` seams."""
        return None

    # activation recomputation ---------------------------------------------------------------
    def selective_unit(self, block: nn.Module) -> nn.Module | None:
        """What `recompute=selective` recomputes whole in `block`; None: the attention cores (`attend` seams)."""
        return None


def parallel_spec(model: nn.Module | Sequence[nn.Module]) -> ModelParallel | None:
    """The spec bound to `model` (`bind_spec`), else the one its `parallel_spec()` method returns; None
    for a model with neither (or a list of blocks)."""
    if not isinstance(model, nn.Module):
        return None
    bound = model.__dict__.get(_BOUND)
    if bound is not None:
        return bound
    own = getattr(model, "parallel_spec", None)
    return own() if callable(own) else None


def bind_spec(model: nn.Module, spec: ModelParallel) -> None:
    """Make `spec` the answer of `parallel_spec(model)`: how a caller that knows the model's package (the
    engine, for a bare transformers model) hands its spec to the strategies, which never import a model."""
    object.__setattr__(model, _BOUND, spec)  # a plain attribute: not a submodule, not in the state dict


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of `model`'s decoder layers: its spec's, else `largest_block_list(model)`."""
    spec = parallel_spec(model)
    return largest_block_list(model) if spec is None else spec.decoder_layers()


def largest_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList of identical block classes holding the most parameters (None if there is none)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    return None if best is None else (best[1], best[2])
