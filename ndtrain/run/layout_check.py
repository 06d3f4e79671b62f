"""The launcher's dry run of a layout: every refusal the model parallelism can meet, decided before any
worker starts and before the run directory is made.

The run's model is built on the meta device (`models/build.build_meta_model`: the modules and shapes
the workers build, no memory, no weights read), with its LoRA adapters (`lora.targets` checked against its
linear layers for every layout), named and given its spec as the engine does, then
handed to the code the workers run on it — `parallel/compose.prepare_model` (the tp plan and its
head/feature divisibility, recomputation, context parallel's attention seam, the pipeline cut and its
layers per stage) — with a `ParallelContext` of one process (`dry_run_context`), and to the checks the
workers make on their first batch: the sequence split of context parallel (`check_sequence_split`),
sequence parallelism's cut over tp (`check_sequence_parallel`) and the pipeline schedule's
micro-batches (`schedules.check`). Each refusal is the workers' own `UserError`, one line.

The context's axis groups have the layout's sizes and this rank's coordinates, but no process group:
nothing here communicates (`prepare_model` issues no collective). A measured pipeline balance is cut
by parameters here: a meta model cannot be timed, and where the cut falls does not decide whether it
can be made (layers against stages is checked before any measurement). The dry run is made for the first
and the last rank of the world, which between them hold the first and last pipeline stage and tp, cp
ranks at both ends. A parameter-server run (ps.servers > 0) has no model parallelism to check
(`check_ps_config` refuses it), and a task other than the language model (e.g. `digits`) builds its
own model in the workers: neither is dry-run here.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from ndtrain.checkpoint.run_model import with_lora
from ndtrain.config import TrainConfig
from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.mesh import AXES, GROUP_AXES, ParallelContext, group_members, rank_coords
from ndtrain.models.build import build_meta_model
from ndtrain.models.hf_parallel import spec_of
from ndtrain.parallel.compose import prepare_model
from ndtrain.parallel.model.context import check_sequence_split
from ndtrain.parallel.model.tensor import check_sequence_parallel
from ndtrain.parallel.model_spec import bind_spec
from ndtrain.parallel.pipeline import schedules
from ndtrain.parallel.placement import name_parameters
from ndtrain.run.tasks import TASKS


def check_layout_on_meta(cfg: TrainConfig, world_size: int) -> None:
    """Refuse (UserError, the workers' own line) a layout of `world_size` ranks the run's model cannot take."""
    p = cfg.parallel
    if cfg.ps.servers or cfg.model.preset in TASKS:
        return
    if cfg.lora.r:  # lora.targets against the model's linear layers, whatever the layout
        with_lora(build_meta_model(cfg.model), cfg.lora, cfg.seed)
    if p.tp * p.cp * p.pp == 1:
        return
    dp = p.resolve_dp(world_size)
    sizes = {"dp": dp, "cp": p.cp, "pp": p.pp, "tp": p.tp}
    if p.cp > 1:
        check_sequence_split(cfg.model.seq_len, p.cp)
    if p.sequence_parallel:
        check_sequence_parallel(cfg.model.seq_len // p.cp, p.tp)
    if p.pp > 1:
        schedules.check(p.pp_schedule, p.pp, cfg.schedule.accumulation_steps(dp), p.pp_virtual)
    for rank in sorted({0, world_size - 1}):
        model = with_lora(build_meta_model(cfg.model), cfg.lora, cfg.seed)
        name_parameters(model)
        spec = spec_of(model)
        if spec is not None:
            bind_spec(model, spec)
        prepare_model(model, dry_run_context(sizes, rank), dataclasses.replace(p, pp_balance="params"))


def dry_run_context(sizes: dict[str, int], rank: int) -> ParallelContext:
    """Rank `rank` of a layout of `sizes` (dp, cp, pp, tp) in one process: every group has the layout's
    members and this rank's place, none a process group (a collective on it would fail: none is issued)."""
    world_size = 1
    for axis in AXES:
        world_size *= sizes[axis]
    groups: dict[str, Group] = {}
    for name, axes in GROUP_AXES.items():
        members = next(m for m in group_members(axes, sizes) if rank in m)
        groups[name] = Group(name, members, members.index(rank))
    return ParallelContext(
        rank=rank, world_size=world_size, local_rank=0, device=torch.device("meta"), backend="none",
        sizes=dict(sizes), coords=rank_coords(rank, sizes), groups=groups,
        comm=Communicator(rank, timedelta(seconds=1)),
    )
