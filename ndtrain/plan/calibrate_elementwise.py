"""The element-wise rate of ndtrain's own layers on this CPU: the kernel profile `--calibrate` measures.

A GPU run's element-wise work is priced from its kernel profile's counted bytes at η_ew of the HBM
bandwidth (`kernels.py`). On a CPU the planner runs ndtrain's own layers, which are eager PyTorch: the
calibration times their element-wise chain for one layer's forward — two RMSNorms, the rotary
embedding of q and k, SwiGLU's silu·product and two residual adds, with ndtrain's `RMSNorm` and
`apply_rotary` at `TOKENS` tokens of a layer of `HIDDEN` (fp32, as CPU processes train) — and divides
the bytes the eager profile counts for that layer by the measured seconds: the achieved element-wise
GB/s of this CPU on this code. `cpu_profile.load_profile` turns it into η_ew relative to the measured
copy bandwidth, which is what a profile without layer pieces prices element-wise work with.
Imported only inside calibration workers (it needs torch).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ndtrain.models.llama import RMSNorm, apply_rotary, rotary_tables
from ndtrain.plan.kernels import EAGER, LayerWidths

TOKENS, HIDDEN, HEADS, FFN = 8192, 512, 8, 1408  # tensors of 16–46 MB: beyond the caches


def counted_bytes() -> float:
    """Bytes the eager profile counts for the measured chain (fp32: twice its 2-byte counts)."""
    widths = LayerWidths(hidden=HIDDEN, ffn=FFN, qk=2 * HIDDEN, attention=HIDDEN, qkv=3 * HIDDEN, mlp_in=2 * FFN)
    return TOKENS * EAGER.layer_bytes_per_token("llama", widths, dropout=False) * 4 / 2  # q, k: as many heads


def measure(timed: Callable[[Callable[[], None]], float]) -> float:
    """Achieved element-wise GB/s of ndtrain's layer ops; `timed(fn)` returns the median seconds of fn()."""
    torch.manual_seed(0)
    head_dim = HIDDEN // HEADS
    x, residual = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    q, k = (torch.randn(1, HEADS, TOKENS, head_dim) for _ in range(2))
    gate, up = torch.randn(TOKENS, FFN), torch.randn(TOKENS, FFN)
    cos, sin = rotary_tables(torch.arange(TOKENS), head_dim, 10000.0)
    norm = RMSNorm(HIDDEN, 1e-5)

    @torch.no_grad()
    def chain() -> None:
        norm(x), norm(residual)
        apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        F.silu(gate) * up
        x + residual, residual + x

    return counted_bytes() / timed(chain) / 1e9
