"""Context parallel: the sequence split over the `cp` group, attention by passing K/V around a ring.

What is split: every sequence of T tokens. It is cut into 2c chunks of n = T/(2c) tokens (c = cp
size) and group rank i holds chunks i and 2c−1−i (load-balanced causal layout: an early, cheap
chunk paired with a late, expensive one), so each rank holds T/c tokens, in increasing position
order, and passes their global positions to the model (RoPE). Every op but attention is
per-token and runs on the shard unchanged; the loss is the mean over the local tokens, and as
shards are equal-sized the mean over the dp×cp group (our `DistributedDataParallel` averages gradients over
`dp_cp`) is the global mean.

Attention (`Attention.attend`, replaced by `apply_context_parallel`) is ring attention. With
B batch, H query heads, K kv heads, h head size, s = T/c local tokens and fp32 accumulation:
- forward, c steps: at step t a rank holds the K/V of group rank r−t; it posts the exchange of
  that block with its ring neighbours (one batched send to r+1 and receive from r−1 of the stacked
  K/V, 2·B·K·s·h elements) and computes its block while the bytes travel. Block results are
  merged with an online log-sum-exp softmax. With this layout a block is causal (t = 0: the
  rank's own chunks, in order) or a full rectangle without mask (t > 0, sender j = r−t mod c:
  if j < r, all local queries against j's early chunk; if j > r, the local late chunk against
  both of j's chunks), and every rank does the same work: one causal 2n×2n block plus c−1
  rectangles of 2n² scores.
- backward, c steps: K/V rotate again (overlapped the same way) while the gradients dK/dV of
  each block travel with it, each rank adding its contribution; after the last step the sums
  arrive at their owners. dQ stays local. The probabilities are recomputed per block from the
  saved log-sum-exp (flash-attention style): nothing quadratic in s is kept.
Each block is computed by one of two kernels (attention_blocks.py; `Ring.kernel`, `block_kernel` picks):
- "fused": SDPA's fused flash kernel (`torch.ops.aten._scaled_dot_product_flash_attention` on
  CUDA in bf16/fp16 with head size ≤ 256, its `_for_cpu` variant on CPU), called per block (causal
  at t = 0, unmasked after) with the block's rows and columns; its fp32 log-sum-exp merges the
  blocks, and its backward is called per block with the final output and log-sum-exp (ring flash
  attention). K/V heads are repeated to the query heads for the kernel (GQA) and their gradients
  summed back. The default on CUDA where the flash kernel takes the dtype and head size.
- "tiles": our own, in tiles of at most `tile` × `tile` scores computed in fp32, merged by the
  same online softmax (causal tiles wholly in the future are skipped), so the transient memory
  is O(B·H·tile²), not O(B·H·s²). The default on CPU, for fp32 and float64 on CUDA, and wherever
  the flash kernel does not apply.
Communication per layer and rank: forward (c−1)·2BKsh elements; backward (c−1)·2BKsh (K/V) +
c·2BKsh (dK/dV, fp32). Saved for backward per layer: q, k, v, out and the log-sum-exp (fp32,
B·H·s), the same tensors as `scaled_dot_product_attention`, so activation memory per rank is
1/c of the unsharded model's. Transient: two K/V buffers and two dK/dV buffers in flight, and
a few tiles of scores (B·H·tile² fp32 each; the fused kernel: its own on-chip tiles, plus the
repeated K/V of one block under GQA). Tiles are computed in fp32 whatever the input dtype, the
fused kernel in the input dtype with fp32 softmax statistics (bf16 K/V travel as bf16; dK/dV travel
and accumulate in fp32; the output accumulates in fp32); a float64 model in float64.
Recomputing ring attention (selective or full recompute) runs the forward ring again inside
backward: (c−1) more K/V exchanges per layer.

In the tiles GQA needs no copies: a query head g·(H/K)+j reads kv head g through broadcasting.

Packed documents (parallel/model/documents.py): given the local tokens' per-row positions [B, s]
(`shard_sequence` cuts a batch's positions [B, T] like its tokens), each rank computes its tokens'
document keys (row index − position; the ring knows its chunks' row indices), and the keys travel
with the K/V they belong to, in the same batched exchange: B·s int64 more per forward step, c−1
messages per layer; the c key blocks a rank held are kept for backward (B·T int64 per layer) and
not sent again. Every tile masks query/key pairs of different documents on top of causality, so
the whole step runs on the tiles kernel (the fused flash kernel takes no arbitrary mask): with
positions given, "fused" and "auto" give tiles. A tile where a row sees no key of its document
adds nothing to that row (its log-sum-exp −inf is merged as zero weight, never NaN); every row sees
itself, so the final log-sum-exp is finite. Without positions (the shard's global positions [s],
shared by the rows) nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group, Pending
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.model.attention_blocks import Kernel, Block, block_kernel, tile_forward, tile_backward, fused_forward, fused_backward
from ndtrain.parallel.model.documents import Documents, document_keys
from ndtrain.parallel.model_spec import parallel_spec
from ndtrain.parallel.precision import at_least_fp32, master_dtype

Chunks = tuple[int, ...]
KERNELS: tuple[Kernel, ...] = ("auto", "fused", "tiles")
DEFAULT_TILE = 512  # rows and columns of the score tiles: transient memory B·H·tile²·4 bytes, a few times


def balanced_chunks(rank: int, cp: int) -> Chunks:
    """Chunk indices (of 2·cp) held by group rank `rank`: i and 2·cp−1−i."""
    return (rank, 2 * cp - 1 - rank)


def contiguous_chunks(rank: int, cp: int) -> Chunks:
    """The unbalanced split, for comparison: rank i holds chunks 2i and 2i+1 (one contiguous piece)."""
    return (2 * rank, 2 * rank + 1)


def check_sequence_split(seq_len: int, cp: int) -> None:
    """UserError unless a sequence of `seq_len` tokens splits into the 2·cp chunks of the balanced split."""
    if seq_len % (2 * cp):
        raise UserError(
            f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp}: "
            f"use a sequence length that is a multiple of {2 * cp} (or a smaller cp)"
        )


def chunk_index(chunks: Chunks, chunk_len: int, device: torch.device) -> torch.Tensor:
    """Row indices [len(chunks)·chunk_len] of the tokens in `chunks`, in order."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in chunks])


def shard_sequence(
    tokens: torch.Tensor, targets: torch.Tensor, ctx: ParallelContext, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's part of `tokens`/`targets` [B, T] and its positions: its part of the per-row
    `positions` [B, T] (packed documents) when given, else its global positions [T/cp]."""
    group = ctx.group("cp")
    seq_len = tokens.shape[-1]
    check_sequence_split(seq_len, group.size)
    index = chunk_index(balanced_chunks(group.rank, group.size), seq_len // (2 * group.size), tokens.device)
    return tokens[..., index], targets[..., index], index if positions is None else positions[..., index]


def block_plan(q_chunks: Chunks, kv_chunks: Chunks, chunk_len: int) -> Block | None:
    """The block of queries in `q_chunks` against keys in `kv_chunks` (ascending chunk indices).

    Chunk pairs are full (key chunk earlier), diagonal (the same chunk) or empty (later). The
    same chunks give one causal block; otherwise the visible pairs must form one rectangle."""
    if q_chunks == kv_chunks:
        span = slice(0, len(q_chunks) * chunk_len)
        return Block(span, span, causal=True)
    visible = [(i, j) for i, a in enumerate(q_chunks) for j, b in enumerate(kv_chunks) if b < a]
    if not visible:
        return None
    rows = sorted({i for i, _ in visible})
    cols = sorted({j for _, j in visible})
    contiguous = rows[-1] - rows[0] + 1 == len(rows) and cols[-1] - cols[0] + 1 == len(cols)
    if len(visible) != len(rows) * len(cols) or not contiguous:
        raise ValueError(f"chunks {q_chunks} against {kv_chunks} do not form one block")
    return Block(
        slice(rows[0] * chunk_len, (rows[-1] + 1) * chunk_len), slice(cols[0] * chunk_len, (cols[-1] + 1) * chunk_len),
        causal=False,
    )


def attention_work(seq_len: int, cp: int, balanced: bool = True, tile: int = DEFAULT_TILE) -> list[int]:
    """Score entries (query·key pairs, evaluated densely per tile) each rank computes in one
    ring-attention forward; FLOPs are 4·B·H·h times this. `balanced=False`: the contiguous split."""
    layout = balanced_chunks if balanced else contiguous_chunks
    n = seq_len // (2 * cp)
    work = []
    for rank in range(cp):
        blocks = (block_plan(layout(rank, cp), layout((rank - t) % cp, cp), n) for t in range(cp))
        work.append(sum(t.scores() for b in blocks if b is not None for t in b.tiles(tile)))
    return work


@dataclass(frozen=True)
class Ring:
    """The cp group a ring attention runs on and the chunks every member holds."""

    comm: Communicator
    group: Group
    tile: int = DEFAULT_TILE
    kernel: Kernel = "auto"  # how each block is computed (module docstring; `block_kernel`)

    def chunks(self, group_rank: int) -> Chunks:
        return balanced_chunks(group_rank % self.group.size, self.group.size)

    def block(self, step: int, local_len: int) -> Block | None:
        """The block computed at `step`, holding the K/V of group rank r − step (None: nothing visible)."""
        return block_plan(self.chunks(self.group.rank), self.chunks(self.group.rank - step), local_len // 2)

    def tiles(self, step: int, local_len: int) -> list[Block]:
        """The tiles computed at `step` (the "tiles" kernel)."""
        block = self.block(step, local_len)
        return [] if block is None else list(block.tiles(self.tile))

    def index(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Row indices [local_len] of the tokens this rank holds."""
        return chunk_index(self.chunks(self.group.rank), local_len // 2, device)

    def exchange(self, *send: torch.Tensor) -> tuple[list[torch.Tensor], Pending]:
        """Post: send the tensors `send` to the next rank, receive the previous rank's into new buffers."""
        received = [torch.empty_like(t) for t in send]
        size, rank = self.group.size, self.group.rank
        pending = self.comm.batch_send_recv([(t, (rank + 1) % size) for t in send],
                                            [(t, (rank - 1) % size) for t in received], self.group)
        return received, pending


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        fctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, heads, seq, head_dim = q.shape
        fused = positions is None and block_kernel(ring.kernel, q) == "fused"
        q_blocks = q if fused else q.reshape(batch, k.shape[1], heads // k.shape[1], seq, head_dim)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        kv = torch.stack((k, v))
        # packed documents: the document keys of the local tokens travel with their K/V
        keys = [] if positions is None else [document_keys(positions, ring.index(seq, q.device))]
        local_keys = keys[0] if keys else None
        held_keys: list[torch.Tensor] = []  # the keys of the K/V held at each step, for backward
        size = ring.group.size
        acc = master_dtype(q.dtype)  # fp32, or float64 for a float64 model
        out = torch.zeros(q_blocks.shape, dtype=acc, device=q.device)
        lse = torch.full(q_blocks.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        extras: list[tuple[torch.Tensor, ...]] = []  # the fused kernel's per-block state for backward
        for step in range(size):  # step 0: the rank's own chunks, a causal block where every row sees itself
            if step < size - 1:
                (next_kv, *next_keys), pending = ring.exchange(kv, *keys)  # travels while this block is computed
            block = ring.block(step, seq)
            documents = None if local_keys is None else (local_keys, keys[0])  # (query keys, key keys)
            held_keys.extend(keys)
            if fused and block is not None:
                extras.append(fused_forward(q, kv, block, scale, out, lse))
            elif block is not None:
                for tile in block.tiles(ring.tile):
                    tile_forward(q_blocks, kv, tile, scale, out, lse, documents)
            if step < size - 1:
                pending.wait()
                kv, keys = next_kv, next_keys
        result = out.to(q.dtype).view(batch, heads, seq, head_dim)
        fctx.save_for_backward(q, k, v, result, lse)
        fctx.ring, fctx.scale, fctx.fused, fctx.extras, fctx.held_keys = ring, scale, fused, extras, held_keys
        return result

    @staticmethod
    def backward(  # type: ignore[override]
        fctx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, out, lse = fctx.saved_tensors
        ring: Ring = fctx.ring
        batch, heads, seq, head_dim = q.shape
        scale, fused = fctx.scale, fctx.fused
        if fused:
            q_blocks, dout, out_blocks = q, grad_out.contiguous(), out
        else:
            shape5 = (batch, k.shape[1], heads // k.shape[1], seq, head_dim)
            q_blocks, dout = q.reshape(shape5), at_least_fp32(grad_out.reshape(shape5))
            out_blocks = at_least_fp32(out.reshape(shape5))
            delta = (dout * out_blocks).sum(dim=-1)
        dq = torch.zeros(q_blocks.shape, dtype=master_dtype(q.dtype), device=q.device)
        kv = torch.stack((k, v))
        size = ring.group.size
        extras = iter(fctx.extras)
        incoming = None  # (dK/dV buffer, pending) from the previous rank
        held_keys = fctx.held_keys
        for step in range(size):
            if step < size - 1:
                (next_kv,), kv_pending = ring.exchange(kv)
            dkv = torch.zeros(kv.shape, dtype=master_dtype(kv.dtype), device=kv.device)
            block = ring.block(step, seq)
            documents = (held_keys[0], held_keys[step]) if held_keys else None
            if fused and block is not None:
                fused_backward(q, kv, dout, out_blocks, lse, block, scale, next(extras), dq, dkv)
            elif block is not None:
                for tile in block.tiles(ring.tile):
                    tile_backward(q_blocks, kv, dout, lse, delta, tile, scale, dq, dkv, documents)
            if incoming is not None:
                incoming[1].wait()
                dkv += incoming[0][0]
            if size > 1:
                incoming = ring.exchange(dkv)  # to the holder of this K/V next; last step: to its owner
            if step < size - 1:
                kv_pending.wait()
                kv = next_kv
        if incoming is not None:
            incoming[1].wait()
            dkv = incoming[0][0]
        return dq.to(q.dtype).view(q.shape), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class RingAttend:
    """The `attend(q, k, v, documents)` seam as ring attention over one cp group."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
                 ) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.ring, None, None if documents is None else documents.positions)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the local q [B, H, s, h] over the whole sequence's k, v [B, K, s, h] per rank;
    scores scaled by `scale` (default 1/√h); with the local tokens' per-row `positions` [B, s] of packed
    documents, within each document only."""
    return _RingAttention.apply(q, k, v, ring, scale, positions)


def apply_context_parallel(model: nn.Module, ctx: ParallelContext, *, tile: int = DEFAULT_TILE,
                           kernel: Kernel = "auto") -> nn.Module:
    """Give every attention of `model` ring attention over ctx's cp group: the model's own way when its
    spec has one (a Hugging Face model: transformers' attention registry, models/hf_context.py), else
    every module with an `attend` seam.

    A wrapper already on the seam (one exposing `.inner`, e.g. selective recompute) is kept and
    gets ring attention inside it, so the order of the two does not matter. `tile`, `kernel`: the
    ring's (`Ring`)."""
    ring = Ring(ctx.comm, ctx.group("cp"), tile, kernel)
    spec = parallel_spec(model)
    routed = None if spec is None else spec.context_parallel(ring)
    if routed is not None:
        return routed
    core = RingAttend(ring)
    attentions = [m for m in model.modules() if hasattr(m, "attend")]
    if not attentions:
        raise UserError(f"{type(model).__name__} has no attention with an `attend` seam: context parallel needs one")
    for attention in attentions:
        if hasattr(attention.attend, "inner"):
            attention.attend.inner = core
        else:
            attention.attend = core
    return model
