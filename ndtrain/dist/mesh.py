"""`ParallelContext`: the process groups of every axis of the layout, and this rank's place in it.

world = dp × cp × pp × tp, tp varying fastest, so global rank r has coordinates
    tp = r % tp,  pp = (r // tp) % pp,  cp = (r // (tp·pp)) % cp,  dp = r // (tp·pp·cp).
Groups are built once, on every rank in the same order: one per axis, `dp_cp` (gradient
synchronisation), `mp` = pp × tp (the ranks that together hold one model replica, for the global
gradient norm) and `world`. Groups of one rank need no c10d communicator and get none.
A multi-process context's communicator has a `Watchdog` (dist/watchdog.py) on the default store, so
a stall ends every live rank with a message naming the ranks that did not arrive. The watchdog is
started on the rendezvous store before the process group is built with that store, so joining the
group (rendezvous and group creation) is watched as the first step of start-up (`ctx.phases`,
dist/phases.py); the same `Phases` watch evaluation, saves and loads for the trainer and engine.
The world (rank, size, rendezvous) is what the launcher says: torchrun, mpirun or srun (dist/launchers.py).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ndtrain.dist.comm import Communicator, Group
from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.launchers import detect
from ndtrain.dist.phases import Phases
from ndtrain.dist.watchdog import Watchdog

AXES = ("dp", "cp", "pp", "tp")
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp",), "cp": ("cp",), "pp": ("pp",), "tp": ("tp",),
    "dp_cp": ("dp", "cp"), "mp": ("pp", "tp"), "world": AXES,
}


@dataclass
class ParallelContext:
    """The topology of this process: its rank and device, every axis's size, its coordinates and groups,
    and the counted collectives. Strategy options (zero, precision, schedules...) are not here: they
    are the `ParallelConfig` given to `Engine`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, Group]
    comm: Communicator
    phases: Phases = field(default_factory=Phases)  # deadlines of start-up, evaluation, saves (dist/phases.py)

    def group(self, name: str) -> Group:
        return self.groups[name]

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def destroy(self) -> None:
        if self.comm.watchdog is not None:
            self.comm.watchdog.stop()
            self.comm.watchdog = self.phases.watchdog = None
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_coords(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    coords, rest = {}, rank
    for axis in reversed(AXES):
        coords[axis] = rest % sizes[axis]
        rest //= sizes[axis]
    return {axis: coords[axis] for axis in AXES}


def coords_rank(coords: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + coords[axis]
    return rank


def group_members(axes: tuple[str, ...], sizes: dict[str, int]) -> list[tuple[int, ...]]:
    """All groups varying `axes` with the other coordinates fixed, each in group-rank order."""
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
        base = dict(zip(fixed, fixed_values))
        members = []
        for varying in itertools.product(*(range(sizes[a]) for a in axes)):
            members.append(coords_rank({**base, **dict(zip(axes, varying))}, sizes))
        groups.append(tuple(members))
    return groups


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("parallel.device='cuda' but no CUDA device is visible: use device='cpu' or 'auto'")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("parallel.backend='nccl' needs CUDA devices: use backend='gloo' (or 'auto') on CPU")
    if backend == "mpi" and not dist.is_mpi_available():
        raise UserError("parallel.backend='mpi' but this torch build has no MPI support: use 'gloo' or 'nccl'")
    return backend


def init(config: ParallelConfig | None = None, init_method: str | None = None, *,
         started: float | None = None, store: Any = None) -> ParallelContext:
    """Join the world its launcher describes (torchrun, mpirun, srun: dist/launchers.py; else a single
    process) and build all groups.

    `started`: the `time.monotonic()` reading the start-up deadline counts from (a worker passes its
    process's start, `phases.process_started()`); default: now. `store`: a store the ranks already
    share at the launcher's rendezvous (the CLI's, under mpirun or srun), used instead of a new one."""
    config = config or ParallelConfig()
    config.validate()
    launch = detect(os.environ)
    rank, world_size, local_rank = launch.rank, launch.world_size, launch.local_rank
    dp = config.resolve_dp(world_size)
    sizes = {"dp": dp, "cp": config.cp, "pp": config.pp, "tp": config.tp}
    device = resolve_device(config.device, local_rank)
    backend = resolve_backend(config.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=config.timeout_s)
    comm = Communicator(rank, timeout)
    phases = Phases(config)
    if world_size > 1:
        store = _rendezvous(store, init_method or launch.init_method(), rank, world_size, timeout)
    else:
        store = None
    if store is not None:
        comm.watchdog = phases.watchdog = Watchdog(
            rank, store, config.watchdog_s, comm.issued, world_size=world_size).start()
    with phases.startup("joining the process group", started):
        if store is not None and not dist.is_initialized():
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        groups = _build_groups(rank, world_size, sizes, timeout)
    return ParallelContext(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device,
        backend=backend, sizes=sizes, coords=rank_coords(rank, sizes), groups=groups, comm=comm, phases=phases,
    )


def _rendezvous(store: Any, init_method: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The store the process group is built on, as `init_process_group` would make it (the given
    store or the rendezvous behind `init_method`, prefixed "default_pg"); the existing group's when
    there is one."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if store is None:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)


def _build_groups(rank: int, world_size: int, sizes: dict[str, int], timeout: timedelta) -> dict[str, Group]:
    groups: dict[str, Group] = {}
    for name, axes in GROUP_AXES.items():
        for members in group_members(axes, sizes):
            if len(members) == 1 or len(members) == world_size:
                pg = dist.group.WORLD if len(members) > 1 else None
            else:
                pg = dist.new_group(list(members), timeout=timeout)
            if rank in members:
                groups[name] = Group(name, members, members.index(rank), pg)
    return groups
