"""One block of causal attention and its gradient, as ring attention computes it (context.py):
`Block` (the query rows × key columns a ring step computes, causal or full), and the two kernels
that compute it and merge it into the running output by its log-sum-exp —

- tiles (`tile_forward`, `tile_backward`): our own, in tiles of at most tile × tile scores in fp32
  (float64 for a float64 model), causal tiles wholly in the future skipped; any device and dtype;
  the only kernel that also masks query/key pairs of different packed documents (documents.py),
  given both sides' document keys;
- fused (`fused_forward`, `fused_backward`): SDPA's flash kernel on the block (CUDA in bf16/fp16,
  its `_for_cpu` variant on CPU), K/V heads repeated to the query heads (GQA) and their gradients
  summed back; `block_kernel` picks it where it applies.

Nothing here communicates; memory and costs are in context.py's docstring.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from ndtrain.parallel.model.documents import same_document
from ndtrain.parallel.precision import at_least_fp32

Kernel = Literal["auto", "fused", "tiles"]


@dataclass(frozen=True)
class Block:
    """The scores one step computes: local query rows × held key columns, causal or full."""

    rows: slice
    cols: slice
    causal: bool

    def scores(self) -> int:
        return (self.rows.stop - self.rows.start) * (self.cols.stop - self.cols.start)

    def tiles(self, size: int) -> Iterator[Block]:
        """Sub-blocks of at most size × size scores; in a causal block (rows and columns in the same
        index space) those wholly in the future are skipped and only those the diagonal crosses
        stay causal."""
        for r0 in range(self.rows.start, self.rows.stop, size):
            r1 = min(r0 + size, self.rows.stop)
            for c0 in range(self.cols.start, self.cols.stop, size):
                c1 = min(c0 + size, self.cols.stop)
                if self.causal and c0 > r1 - 1:
                    break
                yield Block(slice(r0, r1), slice(c0, c1), causal=self.causal and c1 - 1 > r0)


DocumentKeys = tuple[torch.Tensor, torch.Tensor]  # (the local queries' [B, s], the held keys' [B, s]): documents.py


def _tile_scores(q: torch.Tensor, k: torch.Tensor, tile: Block, scale: float,
                 documents: DocumentKeys | None) -> torch.Tensor:
    """Scaled scores [B,K,G,r,c] of q rows [B,K,G,r,h] against k columns [B,K,1,c,h], the future and
    (with `documents`) the pairs of different documents masked."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if tile.causal:
        rows = torch.arange(tile.rows.start, tile.rows.stop, device=q.device)
        cols = torch.arange(tile.cols.start, tile.cols.stop, device=q.device)
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    if documents is not None:
        other = ~same_document(documents[0][:, tile.rows], documents[1][:, tile.cols])
        scores = scores.masked_fill(other[:, None, None], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with the −inf of rows that see no key yet made 0, so exp(x − lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Merge a block's output and log-sum-exp of `rows` into the running `out` and `lse` (online
    softmax); a row neither has seen anything in stays 0 with log-sum-exp −inf."""
    old = lse[..., rows]
    merged = torch.logaddexp(old, block_lse)
    safe = _finite(merged)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old - safe).unsqueeze(-1)
                         + block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse[..., rows] = merged


def tile_forward(
    q: torch.Tensor, kv: torch.Tensor, tile: Block, scale: float, out: torch.Tensor, lse: torch.Tensor,
    documents: DocumentKeys | None = None,
) -> None:
    """Attention of q [B,K,G,s,h] rows over kv [2,B,K,s,h] columns, merged into the running fp32
    `out` [B,K,G,s,h] and log-sum-exp `lse` [B,K,G,s] of those rows (online softmax); with
    `documents`, pairs of different documents masked (a row seeing none of the tile's keys gets
    log-sum-exp −inf and adds nothing)."""
    k, v = (at_least_fp32(t[..., tile.cols, :]).unsqueeze(2) for t in kv)
    scores = _tile_scores(at_least_fp32(q[..., tile.rows, :]), k, tile, scale, documents)
    tile_lse = scores.logsumexp(dim=-1)
    tile_out = torch.exp(scores - _finite(tile_lse).unsqueeze(-1)) @ v
    _merge(out, lse, tile.rows, tile_out, tile_lse)


def tile_backward(
    q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    tile: Block, scale: float, dq: torch.Tensor, dkv: torch.Tensor, documents: DocumentKeys | None = None,
) -> None:
    """Add one tile's gradients (probabilities recomputed from the final `lse`, which is finite: every
    row sees itself) into dq and dkv."""
    q_rows = at_least_fp32(q[..., tile.rows, :])
    k, v = (at_least_fp32(t[..., tile.cols, :]).unsqueeze(2) for t in kv)
    probs = torch.exp(_tile_scores(q_rows, k, tile, scale, documents) - lse[..., tile.rows].unsqueeze(-1))
    dout_rows = dout[..., tile.rows, :]
    dscores = probs * (dout_rows @ v.transpose(-1, -2) - delta[..., tile.rows].unsqueeze(-1))
    dq[..., tile.rows, :] += (dscores @ k) * scale
    dkv[0][..., tile.cols, :] += (dscores.transpose(-1, -2) @ q_rows).sum(dim=2) * scale
    dkv[1][..., tile.cols, :] += (probs.transpose(-1, -2) @ dout_rows).sum(dim=2)


def block_kernel(kernel: Kernel, q: torch.Tensor) -> Literal["fused", "tiles"]:
    """The kernel blocks of `q` [B, H, s, h] are computed with: "auto" is "fused" on CUDA where the flash
    kernel takes q's dtype (bf16/fp16) and head size (≤ 256, a multiple of 8), else "tiles"."""
    if kernel != "auto":
        return kernel
    flash = q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
    return "fused" if q.is_cuda and flash else "tiles"


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """K/V [B, K, c, h] repeated to the query heads [B, K·groups, c, h] (kv head g serves heads g·G … g·G+G−1)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: [B, K·groups, c, h] summed back to [B, K, c, h]."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(dim=2)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """SDPA's flash kernel on one block: output (q's dtype), fp32 log-sum-exp [B, H, r], and what its
    backward needs besides (CUDA: the sequence bookkeeping and dropout state)."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, extra: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block from the final `out` and `lse` of its rows (the probabilities recomputed)."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def fused_forward(q: torch.Tensor, kv: torch.Tensor, block: Block, scale: float, out: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One block of q [B,H,s,h] over kv [2,B,K,s,h] by the flash kernel, merged into the running
    `out` [B,H,s,h] and `lse` [B,H,s] (fp32); returns what the block's backward needs."""
    groups = q.shape[1] // kv.shape[2]
    k, v = (_repeat_heads(t[..., block.cols, :], groups) for t in kv)
    block_out, block_lse, extra = _flash_forward(q[..., block.rows, :], k, v, block.causal, scale)
    _merge(out, lse, block.rows, block_out, block_lse)
    return extra


def fused_backward(q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    block: Block, scale: float, extra: tuple[torch.Tensor, ...], dq: torch.Tensor,
                    dkv: torch.Tensor) -> None:
    """Add one block's gradients (flash backward with the final `out`, `lse`) into dq and dkv (fp32)."""
    groups = q.shape[1] // kv.shape[2]
    k, v = (_repeat_heads(t[..., block.cols, :], groups) for t in kv)
    rows = block.rows
    dq_b, dk_b, dv_b = _flash_backward(dout[..., rows, :], q[..., rows, :], k, v, out[..., rows, :],
                                       lse[..., rows].contiguous(), block.causal, scale, extra)
    dq[..., rows, :] += dq_b
    dkv[0][..., block.cols, :] += _sum_heads(dk_b, groups)
    dkv[1][..., block.cols, :] += _sum_heads(dv_b, groups)
