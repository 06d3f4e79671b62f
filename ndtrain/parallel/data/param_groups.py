"""Parameter groups: which optimizer options (weight decay, say) each trainable parameter gets.

A `GroupFn(name, param)` returns a parameter's group options (a dict of hashable values; `{}`: the
optimizer's defaults). Every strategy builds its optimizer with `OptimizerFn(groups)` from the
groups these functions define, one group per distinct options dict in order of first appearance
in `module.named_parameters()`: whole parameters for a plain optimizer (`parameter_groups`), this
rank's flat segments under ZeRO (`group_keys` gives the same group indices, so every rank builds
the same list of groups, some possibly empty here). Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

GroupFn = Callable[[str, nn.Parameter], dict[str, Any]]
OptimizerFn = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
GroupKey = tuple  # a group's options as sorted (key, value) pairs


def one_group(name: str, param: nn.Parameter) -> dict[str, Any]:
    """Every parameter in one group, with the optimizer's defaults."""
    return {}


def no_decay_for_vectors(name: str, param: nn.Parameter) -> dict[str, Any]:
    """The usual split: weight decay on matrices and embeddings, none on biases and norm weights."""
    return {"weight_decay": 0.0} if param.ndim < 2 else {}


def group_key(group_fn: GroupFn, name: str, param: nn.Parameter) -> GroupKey:
    """The hashable key of `param`'s group options."""
    return tuple(sorted(dict(group_fn(name, param)).items()))


def group_keys(module: nn.Module, group_fn: GroupFn) -> tuple[dict[GroupKey, int], list[dict[str, Any]]]:
    """Distinct `group_fn` results over the trainable parameters, in order of first appearance:
    (group key -> group index, the options of each group)."""
    keys: dict[GroupKey, int] = {}
    options: list[dict[str, Any]] = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            opts = dict(group_fn(name, p))
            key = tuple(sorted(opts.items()))
            if key not in keys:
                keys[key] = len(options)
                options.append(opts)
    return keys, options


def parameter_groups(module: nn.Module, group_fn: GroupFn = one_group) -> list[dict[str, Any]]:
    """The unsharded parameter groups `group_fn` defines: what a plain optimizer is built from."""
    keys, options = group_keys(module, group_fn)
    groups: list[dict[str, Any]] = [{"params": [], **o} for o in options]
    for name, p in module.named_parameters():
        if p.requires_grad:
            groups[keys[group_key(group_fn, name, p)]]["params"].append(p)
    return groups
