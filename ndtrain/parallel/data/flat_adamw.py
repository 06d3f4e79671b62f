"""Flat AdamW over DDP's gradient buckets: a few fused updates per bucket, optionally while backward runs.

What is flat: for every gradient bucket of a `DistributedDataParallel` (ddp.py) the module's
parameters become views of one flat value buffer laid out like the bucket (its `FlatLayout`, N = 1),
and AdamW's exp_avg and exp_avg_sq of the bucket are two more flat buffers (allocated at the first
step, as torch allocates its state). The state stays keyed by the parameters: `state[p]` holds
views of the flat buffers and one step counter shared by the bucket, so LR schedulers and the
layout-agnostic checkpoints (checkpoint/slices.py: zero 0, whole parameters) see what
`torch.optim.AdamW` shows. State a checkpoint load put in place of the views is copied into the
flat buffers at the next update.

The update: each bucket's elements are cut where the parameter group changes (weight decay on
matrices, none on vectors: `FlatLayout.runs`); each group's runs go through one call of torch's
fused AdamW kernel (`torch._fused_adamw_`, one pass over the memory, CPU and CUDA), or with
`fused=False` through `torch.optim.AdamW`'s own single-tensor arithmetic applied to whole runs
(bit-identical to torch's default CPU AdamW). The arithmetic is AdamW's: decoupled weight decay,
bias corrections, eps outside the square root; amsgrad, maximize, capturable and differentiable
are not supported (`replacing` keeps such an optimizer as it is).

Overlap (`set_overlap(True)`): DDP calls `bucket_reduced(k)` as soon as bucket k is averaged, polled
during backward and in bucket order at its end while later buckets are still on the wire, and the
bucket is updated right there; `step()` then updates only the buckets not updated yet. That is
only right when nothing between backward and `step()` may change or veto the update: the engine
allows it only without gradient clipping (the clip factor needs the global norm of every bucket,
so waiting for it would leave nothing to overlap), without a loss scaler (an overflow skips the
step) and without `skip_nonfinite`. The non-finite guard still stops the run on a NaN/inf loss or
norm, but the buckets were already updated in memory (the run resumes from its newest checkpoint).

When DDP packs its buckets anew (recorded bucket order) the value buffers are rebuilt in the new
layout and the state is copied into new flat buffers at the next update.

Cost: what torch's AdamW holds, 4Ψ values (the parameters themselves) + 8Ψ state; no communication.

`FusedAdamW` (`fused_adamw_factory`): the same lever where the optimizer's parameters are flat
already, ZeRO-1/2/3's shard segments and the fp32 masters of mixed precision: the caller's plain
`torch.optim.AdamW` is rebuilt over the same groups with torch's fused kernel, one pass over each
group's segments instead of the single-tensor update's ~10 passes per segment (on this project's CPU
machine, bench preset at 4 ranks: ZeRO-1's step 32 -> 20 ms). Its state dict is torch's AdamW's, and
loading one keeps the kernel the run's config chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ndtrain.errors import UserError
from ndtrain.parallel.data.buckets import AllReduceBucket

UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


class BucketedGradients(Protocol):
    """What FlatAdamW needs of DDP's `DistributedDataParallel` (ddp.py, which builds this optimizer):
    its gradient buckets, the bucket-averaged callback and the repacking callbacks."""

    @property
    def buckets(self) -> Sequence[AllReduceBucket]: ...

    on_bucket_reduced: Callable[[int], None] | None
    after_reorder: list[Callable[[], None]]

    def zero_grad(self, set_to_none: bool = False) -> None: ...


@dataclass
class _FlatBucket:
    """One bucket's flat values, its group runs, and (after the first update) its flat state."""

    values: torch.Tensor
    runs: dict[int, list[tuple[int, int]]]  # group index -> [start, stop) runs of the bucket
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: torch.Tensor | None = None
    avg_views: list[torch.Tensor] = field(default_factory=list)
    sq_views: list[torch.Tensor] = field(default_factory=list)


class FlatAdamW(torch.optim.Optimizer):
    """AdamW over every trainable parameter of `ddp`, laid out flat bucket by bucket (see the module docstring)."""

    def __init__(
        self, ddp: BucketedGradients, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 1e-2, *, fused: bool | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        wrapped = {id(p) for b in ddp.buckets for p in b.params}
        if mine != wrapped or sum(len(g["params"]) for g in self.param_groups) != len(mine):
            raise UserError("FlatAdamW needs every trainable parameter of the DDP model exactly once in its groups: "
                            "build it from the wrapper's parameters")
        for group in self.param_groups:
            if any(group.get(key) for key in UNSUPPORTED) or isinstance(group["lr"], torch.Tensor):
                raise UserError(f"FlatAdamW does not support {', '.join(UNSUPPORTED)} or a tensor lr: "
                                "use torch.optim.AdamW for those")
        self.ddp = ddp
        first = ddp.buckets[0].flat
        self.fused = _fused_supported(first) if fused is None else fused
        self._group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        self._flats: list[_FlatBucket] = []
        self._stepped: set[int] = set()  # buckets updated during this step's backward
        self._layout()
        ddp.after_reorder.append(self._layout)

    @classmethod
    def replacing(cls, ddp: BucketedGradients, optimizer: torch.optim.Optimizer, *,
                  fused: bool | None = None) -> FlatAdamW | None:
        """A FlatAdamW with `optimizer`'s groups and options when it is a plain, unused `torch.optim.AdamW`
        over exactly `ddp`'s trainable parameters; None otherwise (keep `optimizer`)."""
        groups = _plain_adamw_groups(optimizer)
        if groups is None or sorted(id(p) for g in groups for p in g["params"]) != sorted(
                id(p) for b in ddp.buckets for p in b.params):
            return None
        return cls(ddp, groups, fused=fused)

    def set_overlap(self, on: bool) -> None:
        """Update each bucket as soon as DDP has averaged it (see the module docstring for when that is allowed)."""
        self.ddp.on_bucket_reduced = self.bucket_reduced if on else None

    @property
    def overlapping(self) -> bool:
        return self.ddp.on_bucket_reduced is not None

    # ----------------------------------------------------------------------------- layout
    @torch.no_grad()
    def _layout(self) -> None:
        """Flat value buffers over DDP's current buckets, the parameters made views of them."""
        all_stepped = bool(self._stepped) and len(self._stepped) == len(self._flats)
        if self._stepped and not all_stepped:
            raise RuntimeError("the buckets were packed anew while some of this step's updates were pending")
        self._flats = []
        for bucket in self.ddp.buckets:
            layout = bucket.flat_layout
            values = torch.empty(layout.numel, dtype=bucket.flat.dtype, device=bucket.flat.device)
            for p, view in zip(bucket.params, layout.views(values)):
                view.copy_(p.detach())
                p.data = view
            runs: dict[int, list[tuple[int, int]]] = {}
            for a, b, g in layout.runs([self._group_of[id(p)] for p in bucket.params]):
                runs.setdefault(g, []).append((a, b))
            self._flats.append(_FlatBucket(values, runs))
        self._stepped = set(range(len(self._flats))) if all_stepped else set()

    @torch.no_grad()
    def _ensure_state(self, k: int) -> _FlatBucket:
        """Bucket k's flat state, the parameters' `state` entries views of it (adopting loaded or earlier state)."""
        flat = self._flats[k]
        params = self.ddp.buckets[k].params
        if flat.exp_avg is not None and all(
            self.state[p].get("exp_avg") is a and self.state[p].get("exp_avg_sq") is s and self.state[p].get("step") is flat.step
            for p, a, s in zip(params, flat.avg_views, flat.sq_views)
        ):
            return flat
        steps = {float(self.state[p]["step"]) for p in params if "step" in self.state[p]}
        if len(steps) > 1:
            raise UserError(f"the optimizer state holds different step counts {sorted(steps)} within one bucket: "
                            "FlatAdamW steps all parameters together; set parallel.flat_adamw=false for this run")
        layout = self.ddp.buckets[k].flat_layout
        flat.exp_avg, flat.exp_avg_sq = torch.zeros_like(flat.values), torch.zeros_like(flat.values)
        flat.step = _step_counter(steps.pop() if steps else 0.0, flat.values.device, self.fused)
        flat.avg_views, flat.sq_views = layout.views(flat.exp_avg), layout.views(flat.exp_avg_sq)
        for p, a, s in zip(params, flat.avg_views, flat.sq_views):
            state = self.state[p]
            if "exp_avg" in state:
                a.copy_(state["exp_avg"].reshape(a.shape))
                s.copy_(state["exp_avg_sq"].reshape(s.shape))
            state.update(step=flat.step, exp_avg=a, exp_avg_sq=s)
        return flat

    # ----------------------------------------------------------------------------- update
    def bucket_reduced(self, k: int) -> None:
        """DDP has averaged bucket k: update it now (overlap mode)."""
        self._update(k)
        self._stepped.add(k)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Update every bucket not updated during backward yet, then start the next step afresh."""
        if closure is not None:
            raise UserError("FlatAdamW.step takes no closure: run forward and backward before calling it")
        for k in range(len(self._flats)):
            if k not in self._stepped:
                self._update(k)
        self._stepped = set()

    @torch.no_grad()
    def _update(self, k: int) -> None:
        flat = self._ensure_state(k)
        assert flat.exp_avg is not None and flat.exp_avg_sq is not None and flat.step is not None
        grad = self.ddp.buckets[k].flat
        flat.step += 1
        for g, runs in flat.runs.items():
            group = self.param_groups[g]
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            pieces = [(flat.values[a:b], grad[a:b], flat.exp_avg[a:b], flat.exp_avg_sq[a:b]) for a, b in runs]
            if self.fused:
                values, grads, avgs, sqs = (list(t) for t in zip(*pieces))
                torch._fused_adamw_(values, grads, avgs, sqs, [], [flat.step] * len(values), lr=lr, beta1=beta1,
                                    beta2=beta2, weight_decay=decay, eps=eps, amsgrad=False, maximize=False)
            else:
                for value, g_, avg, sq in pieces:
                    _adamw_exact(value, g_, avg, sq, float(flat.step), lr, beta1, beta2, eps, decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero DDP's gradient buckets in place (the `.grad`s stay bucket views; `set_to_none` is not honoured:
        the update reads the buckets)."""
        self.ddp.zero_grad()


class FusedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` that stays fused when it loads a state dict saved without it
    (torch's `load_state_dict` takes every group option from the saved dict)."""

    def __init__(self, params: Any, **options: Any) -> None:
        super().__init__(params, **options, fused=True)

    @classmethod
    def replacing(cls, optimizer: torch.optim.Optimizer) -> FusedAdamW | None:
        """A FusedAdamW over `optimizer`'s groups, with its options, when it is a plain, unused
        `torch.optim.AdamW` whose parameters the fused kernel supports; None otherwise (keep `optimizer`)."""
        groups = _plain_adamw_groups(optimizer)
        if groups is None or not all(_fused_supported(p) for g in groups for p in g["params"]):
            return None
        return cls(groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=True, foreach=False)
            for p in group["params"]:
                state = self.state.get(p, {})
                if "step" in state:  # the fused kernel reads a float32 step on the parameter's device
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)


def fused_adamw_factory(optimizer_fn: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                        ) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """`optimizer_fn` whose plain `torch.optim.AdamW` comes back as a `FusedAdamW` (anything else as it is)."""

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizer = optimizer_fn(groups)
        return FusedAdamW.replacing(optimizer) or optimizer

    return build


def _plain_adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]] | None:
    """`optimizer`'s groups (parameters and AdamW options) when it is an unused `torch.optim.AdamW`
    (or FusedAdamW) without the options flat updates do not support; None otherwise."""
    if type(optimizer) not in (torch.optim.AdamW, FusedAdamW) or optimizer.state:
        return None
    groups = optimizer.param_groups
    if any(g.get(key) for g in groups for key in UNSUPPORTED) or any(isinstance(g["lr"], torch.Tensor) for g in groups):
        return None
    keep = ("lr", "betas", "eps", "weight_decay", "initial_lr")
    return [{"params": list(g["params"]), **{k: g[k] for k in keep if k in g}} for g in groups]


def _adamw_exact(value: torch.Tensor, grad: torch.Tensor, avg: torch.Tensor, sq: torch.Tensor, step: float,
                 lr: float, beta1: float, beta2: float, eps: float, decay: float) -> None:
    """torch.optim.AdamW's single-tensor update (torch/optim/adam.py, decoupled weight decay), operation by operation."""
    if decay != 0:
        value.mul_(1 - lr * decay)
    avg.lerp_(grad, 1 - beta1)
    sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    value.addcdiv_(avg, denom, value=-step_size)


def _fused_supported(tensor: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel runs on this tensor's device and dtype."""
    return tensor.device.type in ("cpu", "cuda") and tensor.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _step_counter(step: float, device: torch.device, fused: bool) -> torch.Tensor:
    """A bucket's step counter as torch's AdamW keeps it: for the fused kernel float32 on the values'
    device (its CUDA kernel reads the counter there, as a float); otherwise on the CPU, float32, or
    float64 when that is the default dtype."""
    if fused:
        return torch.tensor(step, dtype=torch.float32, device=device)
    return torch.tensor(step, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)
