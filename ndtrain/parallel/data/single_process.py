"""Single-process data parallel: one process drives several devices with threads (the classic
`torch.nn.DataParallel` design, written here from scratch).

What is split: the batch. Every tensor argument of `forward` (top level, or inside tuples, lists
and dicts) is split along dim 0 into k = len(devices) chunks as equal as possible (sizes differ by
at most one, the larger ones first); 0-dim tensors and non-tensor arguments go whole to every
replica. The module (the *master*) lives on devices[0]; the optimizer steps there.

What is communicated, and when (all inside one process, by device-to-device copies):
- Scatter: chunk i of the inputs is copied to devices[i].
- Broadcast: at every forward each parameter and buffer of the master is copied to every device
  with a differentiable copy (`tensor.to(device)` under autograd) into a light *replica* (a shallow
  copy of each submodule whose `_parameters`/`_buffers` hold the copies; tied parameters stay tied).
  On the master's own device the "copy" is the master tensor itself.
- Replicas run forward in parallel, one Python thread per device (grad mode is carried into the
  threads; an exception in a replica is re-raised as `ReplicaError` naming replica and device).
- Gather: outputs come back to devices[0]. Rule: a tensor output with ndim ≥ 1 is concatenated
  along dim 0 (in chunk order); a 0-dim tensor output is taken to be a per-chunk *mean* (a loss)
  and combined as the mean weighted by chunk size, Σ nᵢ·lᵢ / Σ nᵢ, which equals the loss of the
  whole batch when the loss is a mean over items proportional to dim 0 (e.g. mean cross-entropy
  over B·T tokens with a fixed T; not exact for a loss whose normaliser varies per chunk, such as
  masked tokens). Tuples, lists and dicts are gathered element by element; other values
  (ints, strings, None) are returned from replica 0.
- Reduce: `loss.backward()` runs back through the gather copies, the replicas and the broadcast
  copies, so autograd sums every replica's gradient into the master's `.grad` on devices[0].
  No explicit broadcast after the optimizer step: replicas are rebuilt from the master next forward.

Cost per step, with P the parameter bytes (+ buffers), X the input bytes, Y the output bytes and
k devices: device 0 sends (k−1)·P (broadcast) + (k−1)/k·X (scatter) and receives (k−1)·P
(gradients) + (k−1)/k·Y (gather), i.e. ≈ 2(k−1)·P through one device's link, growing linearly
with k, whereas DDP's ring all-reduce moves 2(k−1)/k·P per device whatever k. Memory on
device 0: the master, its gradients, optimizer state and the gathered outputs; on the others a
parameter copy plus activations of their chunk. Device 0 is the bottleneck: all traffic passes
through it, the optimizer runs only there, and one Python process (one GIL) launches every
replica's kernels. That is why DDP (one process per device, symmetric all-reduce overlapped
with backward, `ndtrain.parallel.data.ddp`) replaced this scheme.

Buffers updated in place during forward (BatchNorm running statistics) are not kept consistent:
replicas see copies (on devices[0] the master buffer itself, touched by one replica only when
devices differ); use modules without such state, or the single-device module, when it matters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data import replicated, zero_strategy
from ndtrain.parallel.data.ddp import DDPStrategy
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn
from ndtrain.parallel.data.zero_strategy import ZeroStrategy

__all__ = ["SingleProcessDataParallel", "ReplicaError", "chunk_sizes"]


class ReplicaError(RuntimeError):
    """An exception raised inside one replica's forward, re-raised in the caller naming the device."""


def chunk_sizes(n: int, k: int) -> list[int]:
    """n items over k parts as equal as possible, larger parts first: chunk_sizes(7, 3) == [3, 2, 2]."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _parse_devices(devices: Sequence[torch.device | str]) -> list[torch.device]:
    if isinstance(devices, (str, torch.device)) or devices is None:
        raise UserError(f"devices={devices!r} must be a list of devices, e.g. ['cuda:0', 'cuda:1'] or ['cpu', 'cpu']")
    devs = []
    for d in devices:
        try:
            devs.append(torch.device(d))
        except (RuntimeError, TypeError) as e:
            raise UserError(f"device {d!r} is not a valid torch device: use e.g. 'cuda:0' or 'cpu'") from e
    if not devs:
        raise UserError("devices=[] is empty: give at least one device, e.g. ['cuda:0', 'cuda:1']")
    types = sorted({d.type for d in devs})
    if len(types) > 1:
        raise UserError(f"devices={[str(d) for d in devs]} mix device types {types}: use devices of one type")
    return devs


def _batch_size(obj: Any, found: list[int]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            found.append(obj.shape[0])
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _batch_size(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _batch_size(o, found)


def _scatter(obj: Any, sizes: list[int], devices: list[torch.device]) -> list[Any]:
    """One version of `obj` per device: tensors with dim ≥ 1 split by `sizes`, others copied whole."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj.to(d) for d in devices]
        return [c.to(d) for c, d in zip(obj.split(sizes, dim=0), devices)]
    if isinstance(obj, (tuple, list)):
        parts = [_scatter(o, sizes, devices) for o in obj]
        per = [[p[i] for p in parts] for i in range(len(devices))]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return [type(obj)(*p) for p in per]
        return [type(obj)(p) for p in per]
    if isinstance(obj, dict):
        parts = {key: _scatter(o, sizes, devices) for key, o in obj.items()}
        return [type(obj)((key, v[i]) for key, v in parts.items()) for i in range(len(devices))]
    return [obj for _ in devices]


def _gather(outs: list[Any], sizes: list[int], device: torch.device) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(o.to(device) * (n / total) for o, n in zip(outs, sizes))
        return torch.cat([o.to(device) for o in outs], dim=0)
    if isinstance(first, (tuple, list)):
        items = [_gather([o[i] for o in outs], sizes, device) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    if isinstance(first, dict):
        return type(first)((key, _gather([o[key] for o in outs], sizes, device)) for key in first)
    return first


def _replicate(module: nn.Module, device: torch.device) -> nn.Module:
    """A shallow copy of `module`'s tree whose parameters/buffers are differentiable copies on `device`."""
    copies: dict[int, torch.Tensor] = {}  # id(master tensor) -> copy; keeps tied weights tied

    def copy_of(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in copies:
            copies[id(t)] = t.to(device)
        return copies[id(t)]

    clones: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        if id(m) in clones:
            return clones[id(m)]
        r = m.__new__(type(m))
        r.__dict__ = m.__dict__.copy()
        clones[id(m)] = r
        # Plain tensors (not nn.Parameter) in _parameters: autograd links them to the master.
        r._parameters = {n: copy_of(p) for n, p in m._parameters.items()}
        r._buffers = {n: copy_of(b) for n, b in m._buffers.items()}
        r._modules = {n: (None if c is None else clone(c)) for n, c in m._modules.items()}
        return r

    return clone(module)


def _device_context(device: torch.device):
    if device.type == "cpu":
        return contextlib.nullcontext()
    mod = torch.get_device_module(device.type)
    return mod.device(device) if hasattr(mod, "device") else contextlib.nullcontext()


class SingleProcessDataParallel(nn.Module):
    """Run `module` on chunks of the batch on every device of `devices`, in threads, and gather.

    `module` must already live on devices[0]; its parameters are the only copy that the optimizer
    sees (`self.module.parameters()`, or this wrapper's `parameters()`, which are the same).
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device | str]) -> None:
        super().__init__()
        self.devices = _parse_devices(devices)
        self.module = module
        master = self.devices[0]
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if not _same_device(t.device, master):
                raise UserError(
                    f"{name} is on {t.device} but devices[0] is {master}: move the module there "
                    f"first (module.to({str(master)!r})) or put its device first in devices"
                )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        k = len(self.devices)
        found: list[int] = []
        _batch_size((args, kwargs), found)
        if not found:
            raise UserError("forward got no tensor with a batch dimension to split: pass the batch as tensors")
        n = found[0]
        if any(f != n for f in found):
            raise UserError(f"batch tensors disagree on dim 0 (sizes {found}): give every batch tensor the same size")
        if n < k:
            raise UserError(f"batch size {n} is smaller than the {k} devices: use a batch of at least {k} or fewer devices")
        if k == 1:
            return self.module(*args, **kwargs)
        sizes = chunk_sizes(n, k)
        inputs = _scatter((args, kwargs), sizes, self.devices)
        replicas = [_replicate(self.module, d) for d in self.devices]
        outs = _parallel_run(replicas, inputs, self.devices)
        return _gather(outs, sizes, self.devices[0])


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return a.type == "cpu" or (a.index or 0) == (b.index or 0)
    return a.index == b.index


def _parallel_run(replicas: list[nn.Module], inputs: list[Any], devices: list[torch.device]) -> list[Any]:
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)
    grad_enabled = torch.is_grad_enabled()

    def work(i: int) -> None:
        try:
            args, kwargs = inputs[i]
            with torch.set_grad_enabled(grad_enabled), _device_context(devices[i]):
                results[i] = replicas[i](*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,), name=f"replica-{i}-{devices[i]}") for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if e is not None:
            raise ReplicaError(f"replica {i} on device {devices[i]} failed: {type(e).__name__}: {e}") from e
    return results


# ----------------------------------------------------------------------------- data-parallel strategy
def _replicas(ctx: ParallelContext, cfg: ParallelConfig) -> Callable[[nn.Module], nn.Module]:
    """Wraps a module in `SingleProcessDataParallel` over `parallel.replicas` copies on this rank's device."""
    return lambda module: SingleProcessDataParallel(module, [ctx.device] * cfg.replicas)


def build_replicated(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn,
                     group_fn: GroupFn) -> DDPStrategy | ZeroStrategy:
    """dp_mode=single-process, zero=0: replicas on threads inside each process, DDP across processes."""
    return replicated.build_replicated(model, ctx, cfg, optimizer_fn, group_fn, wrap=_replicas(ctx, cfg))


def build_zero1(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn,
                group_fn: GroupFn) -> ZeroStrategy:
    """dp_mode=single-process, zero=1: as `build_replicated` with the optimizer state sharded over dp_cp."""
    return zero_strategy.build_zero1(model, ctx, cfg, optimizer_fn, group_fn, wrap=_replicas(ctx, cfg))
