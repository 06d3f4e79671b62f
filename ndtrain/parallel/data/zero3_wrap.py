"""Which modules become ZeRO-3 wrapping units: the `parallel.fsdp_wrap` patterns, resolved on a module.

A unit is an outermost module whose name matches one of the patterns (fnmatch over
`named_modules()`). With `wrap="auto"` (the default) the pattern is one unit per decoder layer of
the model's layer list (`model_spec.decoder_layers`: `layers.*` on the built-in Llama,
`hf.model.layers.*` on an HF Llama, `hf.transformer.h.*` on GPT-2, else the largest nn.ModuleList
of identical blocks), or on a pipeline stage the blocks it holds (an nn.ModuleDict of identical
blocks keyed by their index in the whole model); no such list: no pattern, the root unit alone.
`FullyShardedDataParallel` (zero3_parameters.py) puts every parameter left over into its root unit.
Nothing here communicates.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from ndtrain.errors import UserError
from ndtrain.parallel.model_spec import decoder_layers


def wrap_patterns(module: nn.Module, wrap: Sequence[str] | str) -> list[str]:
    """The unit patterns of `wrap` ("auto": each block of the decoder-layer list; [] when there is none)."""
    if isinstance(wrap, str):
        if wrap.strip() == "auto":
            found = decoder_layers(module)
            name = found[0] if found is not None else _stage_layers(module)
            return [] if name is None else [f"{name}.*"]
        return [p.strip() for p in wrap.split(",") if p.strip()]
    return list(wrap)


def _stage_layers(module: nn.Module) -> str | None:
    """The name of a pipeline stage's blocks (an nn.ModuleDict keyed by their index in the whole model)."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleDict) and len(sub) and len({type(child) for child in sub.values()}) == 1:
            return name
    return None


def select_units(module: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The outermost submodules whose names match one of `patterns`, in registration order."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if not name or any(name.startswith(c + ".") for c, _ in chosen):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            chosen.append((name, sub))
    if not chosen:
        names = [n for n, _ in module.named_modules() if n][:6]
        raise UserError(
            f"FSDP wrap patterns {list(patterns)} match no module; module names here include {names}: "
            "give fnmatch patterns over these names (parallel.fsdp_wrap)"
        )
    return chosen
