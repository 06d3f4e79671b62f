"""Composing the model-parallel strategies on one model, in the one order that works.

The engine builds the whole seeded model and names its parameters (`placement.name_parameters`),
then `prepare_model` transforms it in place: tensor parallel (`model/tp_plan.py`, `parallelize`:
slices the weights over tp), activation recomputation (`model/recompute.py`, `apply_recompute`),
context parallel (`model/context.py`, `apply_context_parallel`: ring attention over cp), and finally
the pipeline cut (`pipeline/partition.py`, `split_model`: this rank's stages). It ends by checking
that every parameter of the result carries a `Placement` (`placement.check_placed`: an error names
the first that do not). Nothing here communicates while building; the strategies' own docstrings
give their costs.

Also here, because they need to know every axis at once (the unsupported combinations are
refused earlier, by `ParallelConfig.validate`):
- `ModelParallelState`: the full model of a tp/pp run with the original parameter names (tp
  shards gathered over tp, each pipeline stage contributing its own parameters), for
  `Engine.full_state_dict` (checkpoints write slices instead: `checkpoint/slices.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.model.context import apply_context_parallel
from ndtrain.parallel.pipeline import split_model
from ndtrain.parallel.placement import check_placed, placement_of
from ndtrain.parallel.pipeline.partition import LossFn
from ndtrain.parallel.model.recompute import apply_recompute
from ndtrain.parallel.model.tensor import gather_shard
from ndtrain.parallel.model.tp_plan import parallelize


def prepare_model(
    model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, *, tp_plan: Mapping[str, str] | None = None,
    loss_fn: LossFn | None = None,
) -> nn.Module:
    """`model` (its parameters named: `name_parameters`) split over tp (by `tp_plan`, or the plan
    shipped for the model), recomputed, with ring attention over cp, cut to this rank's pipeline stage
    (one module, or a ModuleList of v chunks for interleaved schedules; the last stage applies
    `loss_fn` when given). `PlacementError` if a parameter of the result carries no `Placement`."""
    if cfg.tp > 1:
        parallelize(model, ctx, tp_plan, sequence_parallel=cfg.sequence_parallel)
    apply_recompute(model, cfg.recompute)
    if cfg.cp > 1:
        apply_context_parallel(model, ctx)
    if cfg.pp > 1:
        stages = split_model(model, ctx, virtual=cfg.pp_virtual, balance=cfg.pp_balance, loss_fn=loss_fn)
        model = stages[0] if len(stages) == 1 else nn.ModuleList(stages)
    check_placed(model)
    return model


class ModelParallelState:
    """The whole model of a tp/pp run, gathered (`full_state_dict`)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, full_shapes: dict[str, torch.Size], virtual: int) -> None:
        """`full_shapes`: the unsharded model's parameter shapes by name (taken before `prepare_model`);
        `virtual`: stage chunks per rank (their index prefixes the chunks' parameter names)."""
        self.module = module
        self.ctx = ctx
        self.full_shapes = full_shapes
        self.virtual = virtual

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Original names and full shapes (collective over tp): each stage's own parameters."""
        out: dict[str, torch.Tensor] = {}
        tp = self.ctx.group("tp")
        for name, param in self.module.named_parameters(remove_duplicate=False):
            name = _original_name(name, self.virtual)
            if name in out:
                continue
            shard = placement_of(param, name).tp
            if shard is not None:
                out[name] = gather_shard(param.detach(), shard, self.full_shapes[name][shard.dim], self.ctx.comm, tp)
            else:
                out[name] = param.detach().clone()
        return out


def _original_name(name: str, virtual: int) -> str:
    """Strip the chunk index a ModuleList of interleaved stages puts in front of each name."""
    return name.split(".", 1)[1] if virtual > 1 else name

