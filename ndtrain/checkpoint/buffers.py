"""A checkpoint's persistent buffers (BatchNorm's running statistics and any other `register_buffer` kept in
the state dict), by their names in the unsharded model.

Buffers have no `Placement` and are not sharded by any strategy: every rank that holds a module holds
its whole buffers. `buffer_names` records, before any strategy wraps the model, where each persistent
buffer lives (its module and key: a cast to the compute dtype replaces the tensor, not the module).
At a save, the rank at coordinate 0 of dp, cp and tp of each pipeline stage writes the buffers of the
modules it holds to `buffers/rankNNNNN.pt` (rank 0's statistics are the run's, as
`parallel.broadcast_buffers` makes them everyone's; with `parallel.sync_batchnorm` they are equal on
every rank anyway). At a load, every rank reads all those files (the manifest lists and verifies
them; `safe_pickle` reads them) and copies each name it holds into its module: the files are keyed by
name, so any layout restores any other's. A checkpoint without the folder (written before buffers
were saved) leaves the buffers as built. Cost: one copy of the buffers per stage, on disk and read by
every rank; no collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


FOLDER = "buffers"
BufferSite = tuple[nn.Module, str]


def buffer_names(model: nn.Module) -> dict[str, BufferSite]:
    """Persistent buffer name in `model` → (module, key) holding it (a shared module's buffer once)."""
    sites: dict[str, BufferSite] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is None or key in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            sites[f"{module_name}.{key}" if module_name else key] = (module, key)
    return sites


def held(sites: dict[str, BufferSite], model: nn.Module) -> dict[str, BufferSite]:
    """The sites whose module is part of `model` (this rank's pipeline stages)."""
    modules = {id(m) for m in model.modules()}
    return {name: site for name, site in sites.items() if id(site[0]) in modules}


def write_buffers(folder: Path, rank: int, sites: dict[str, BufferSite]) -> None:
    """Write the buffers of `sites` into `folder/buffers/rankNNNNN.pt` (nothing when there are none)."""
    if not sites:
        return
    state = {name: module._buffers[key].detach().cpu() for name, (module, key) in sites.items()}  # type: ignore[union-attr]
    (folder / FOLDER).mkdir(exist_ok=True)
    with open(folder / FOLDER / f"rank{rank:05d}.pt", "wb") as file:  # a Python file: a full disk is an OSError
        torch.save(state, file)


def saved_buffers(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every buffer a checkpoint holds, by name (empty for a checkpoint written without them)."""
    from ndtrain.checkpoint.safe_pickle import load_tensors  # DCP's import: only once a checkpoint is read

    state: dict[str, torch.Tensor] = {}
    for file in sorted((checkpoint / FOLDER).glob("rank*.pt")):
        state.update(load_tensors(file))
    return state


def load_buffers(checkpoint: Path, sites: dict[str, BufferSite]) -> None:
    """Copy the checkpoint's buffers into `sites` (a name the checkpoint lacks is left as built)."""
    state = saved_buffers(checkpoint)
    for name, (module, key) in sites.items():
        if name in state:
            current: Any = module._buffers[key]
            current.copy_(state[name].to(device=current.device, dtype=current.dtype))
