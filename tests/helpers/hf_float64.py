"""Gemma's RMSNorm kept in the model's dtype, for float64 parity tests of the Gemma families.

transformers computes Gemma, Gemma2 and Gemma3's RMSNorm in float32 whatever the model's dtype
(`x.float()`, then `(1 + w)` and a cast back). A layout that changes a sum's order by 1e-16 (ring
attention's blocks, a data-parallel shard's matmul) can then flip an fp32 rounding, and AdamW turns
that into large relative errors on the zero-initialised norm weights: 4.8e-4 after 5 steps of Gemma3
under cp2, 6.2e-13 with the norm below (measured, tests/test_hf_declared_pp_cp.py). The same formula,
in the input's dtype, isolates what the parity tests check: ndtrain's split, not transformers' rounding.
"""

from __future__ import annotations

import types

import torch
from torch import nn

GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def _gemma_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x / rms(x) · (1 + w), in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def float64_gemma_norms(model: nn.Module) -> nn.Module:
    """`model` with every Gemma RMSNorm computing in its input's dtype (instance forwards replaced)."""
    for module in model.modules():
        if type(module).__name__ in GEMMA_NORMS:
            module.forward = types.MethodType(_gemma_norm, module)  # type: ignore[method-assign]
    return model
