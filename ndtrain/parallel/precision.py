"""Mixed precision: bf16/fp16 compute copies, fp32 master weights, and fp16's dynamic loss scaling.

What is split: nothing; this file names the dtypes and holds the loss scaler. The model's
parameters are cast to the compute dtype (2 bytes each) and forward/backward run in it; the
optimizer updates fp32 master weights and keeps fp32 state: `ZeroOptimizer` (zero1_optimizer.py) holds the
master slice of this rank (stages 1, 2; the whole master with `sharded=False` for plain DDP) and
copies it back into the compute copy after each step; FSDP (zero3_parameters.py) keeps fp32 shards and gathers
`param_dtype` copies. Gradients are reduced in `parallel.comm_dtype`. A float64 model (tests'
parity references) stays float64 throughout: `master_dtype` and `reduction_dtype` never narrow it
below what it is unless bf16 reduction is asked for.

fp16's narrow exponent range needs loss scaling. `LossScaler` multiplies the loss by S before
backward; afterwards `unscale` multiplies the gradients the optimizer will read (fp32)
by 1/S and looks for inf/NaN on the device (no host synchronisation: the engine reads the flag
with the step's loss and norm, in its one read per step). The verdict is all-reduced (MAX, one
4-byte collective over the whole world: every pipeline stage, tp and cp rank too) so every rank
skips the same steps: on
overflow the step is skipped and S halves; after `growth_interval` consecutive good steps S
doubles. Under pp the last stage scales the loss (pipeline/runner.py); the gradients sent back
carry S to every stage. Cost: one element-wise pass over this rank's
optimizer-visible gradients and 4 bytes of all-reduce per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ndtrain.dist.mesh import ParallelContext
from ndtrain.config.options import Precision

DTYPES: dict[Precision, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` upcast to fp32 if it is less precise (bf16/fp16); fp32 and float64 as they are (no copy)."""
    return t.to(master_dtype(t.dtype))


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of masters, shards and their gradients for parameters of `param_dtype`: fp32 for
    bf16/fp16/fp32, float64 for float64 (never below fp32, never below the parameters)."""
    return torch.promote_types(param_dtype, torch.float32)


def compute_dtype(param_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a sharded model computes in: a 16-bit `param_dtype` (mixed precision) as asked;
    otherwise the masters' (fp32 asks for no mixed precision, so a float64 model stays float64)."""
    return param_dtype if param_dtype.itemsize < 4 else master_dtype(model_dtype)


def reduction_dtype(requested: torch.dtype, grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of `grad_dtype` are reduced in when `requested` is asked for: a 16-bit
    request (bf16) as asked; otherwise `requested` widened to the gradients' dtype (fp32 → float64)."""
    return requested if requested.itemsize < 4 else torch.promote_types(requested, grad_dtype)


class LossScaler:
    """Dynamic loss scale S: skip and halve on inf/NaN gradients, double after `growth_interval` good steps."""

    def __init__(
        self, ctx: ParallelContext, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
        backoff_factor: float = 0.5, growth_interval: int = 2000,
    ) -> None:
        self.ctx = ctx
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide `grads` by S in place; returns a device flag [1] (fp32), 1 when any rank saw inf or
        NaN (the step must be skipped), read by the caller when it reads the step's other figures."""
        flag = torch.zeros(1, device=self.ctx.device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            flag = (~finite).float().reshape(1).to(self.ctx.device)
        self.ctx.comm.all_reduce(flag, self.ctx.group("world"), op=dist.ReduceOp.MAX)
        return flag

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
