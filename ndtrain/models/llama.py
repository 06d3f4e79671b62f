"""A Llama-style decoder-only language model: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Symbols: V vocabulary, d = dim, L layers, H query heads, K kv heads, h = d / H head size,
f = ffn_dim. Parameters (weights only, no biases):

    embedding V·d  +  L · (2·d² + 2·d·K·h  [wq, wo, wk, wv]  +  3·d·f  [w1, w2, w3]  +  2·d  [norms])
    +  d  [final norm]  +  V·d  [output head, absent when tied to the embedding]

Attention projections infer the head count from their output width (`view(..., -1, h)`), so a
tensor-parallel shard of wq/wk/wv holding a subset of heads runs this code unchanged. RoPE tables
are computed per forward from the positions, so nothing position-dependent is in the state_dict.

Seams for the parallel strategies (each an attribute a strategy may replace, never a flag):
- `Attention.attend(q, k, v, documents)`: the position-mixing core (context parallel swaps in ring
  attention); `documents` (parallel/model/documents.py) is None, or the packed documents whose
  query/key pairs across documents it must not mix;
- `Llama.loss_fn(logits, targets)`: the loss on the head's output (tensor parallel swaps in a
  vocab-parallel cross-entropy over logit shards);
- `forward(tokens, targets, positions)`: positions default to 0..T−1; [T] are shared by every row (a
  context-parallel shard's global positions), [B, T] are per row (packed documents: positions restart
  at 0 where a document starts, and attention never crosses a document boundary);
- `embed` / `layers` / `head`: the three parts a pipeline stage is cut from.
How the strategies split this model (tp plan, pipeline stages, recompute figures) is in
models/llama_parallel.py, which `Llama.parallel_spec()` returns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.models.llama_parallel import LlamaParallel
from ndtrain.parallel.model.documents import Documents, packed_documents
from ndtrain.parallel.precision import at_least_fp32
from ndtrain.parallel.target_mean import mean_cross_entropy


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [*positions.shape, head_dim / 2] (positions [T] or [B, T]),
    in fp32, or in `dtype` where that is wider (float64: a float32 table would differ by an ulp between
    CPU and CUDA cos)."""
    wide = torch.promote_types(torch.float32, dtype)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=wide, device=positions.device) / head_dim)
    angles = positions.to(wide)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim of x [B, heads, T, h] by the angles for its T positions
    (tables [T, h/2], or [B, T, h/2] for per-row positions)."""
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = at_least_fp32(x).chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(at_least_fp32(x), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


class Attention(nn.Module):
    """Causal grouped-query self-attention: H query heads share K key/value heads (H/K each)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """Causal attention of q [B, H, T, h] over k, v [B, K, T, h] (K divides H) → [B, H, T, h]; with
        `documents` whose rows have a boundary, within each document only (a block-diagonal causal mask)."""
        mask = None if documents is None else documents.causal_mask()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(·))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding → n_layers `Block`s (in `self.layers`) → RMSNorm → output head to the vocabulary."""

    # Output projections of each block; their init std is scaled by 1/sqrt(2·n_layers).
    RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self) -> None:
        """normal(0, init_std) matrices (block outputs scaled down), norm weights one; uses the global RNG."""
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.ndim == 1:
                    param.fill_(1.0)
                elif name.endswith(self.RESIDUAL_OUTPUTS):
                    param.normal_(0.0, residual_std)
                else:
                    param.normal_(0.0, self.cfg.init_std)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V], or with targets the mean cross-entropy over all B·T tokens (fp32 scalar).

        `positions` are the tokens' places in their sequence: [T] for every row (default 0..T−1), or
        [B, T] per row, restarting at 0 where a packed document starts."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.rotary(positions)
        documents = packed_documents(positions)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, documents)
        return self.head(x, targets)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = next(self.parameters()).dtype
        return rotary_tables(positions, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta, dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """Final norm and output projection; the loss when targets are given."""
        logits = self.output(self.norm(x))
        return logits if targets is None else self.loss_fn(logits, targets)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets ≠ −100 (parallel/target_mean.py), in fp32 (float64 for a float64 model)."""
        return mean_cross_entropy(logits, targets)

    def parallel_spec(self) -> LlamaParallel:
        """What the parallel strategies need to know to split this model (models/llama_parallel.py)."""
        return LlamaParallel(self)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Llama:
    """The model initialised from `seed`: bit-identical in every process; the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Llama(cfg)
    return model.to(device)
