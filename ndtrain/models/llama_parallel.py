"""How the parallel strategies split the built-in Llama (models/llama.py): its `ModelParallel` spec.

`Llama.parallel_spec()` returns `LlamaParallel(self)`, so llama.py imports this module; this one knows
the model only through the instance it is handed (its classes by type, `Llama` in annotations), so
the import points one way.

- Tensor parallel: `LLAMA_PLAN` (Megatron's: q/k/v and w1/w3 by columns, wo and w2 by rows, the
  embedding and the head over the vocabulary, norms whole); query heads split over tp, kv heads split
  when tp divides them and otherwise replicated (`Heads`); after the split the model's `loss_fn`
  becomes the vocab-parallel cross-entropy and `head` returns full-vocabulary logits when called
  without targets (one all-gather of the logit shards). With sequence parallelism the vocab
  embedding reduce-scatters the sequence (no `SequenceCut`).
- Pipeline: the blocks are `layers`; stage 0 adds the embedding, the last stage the final norm,
  head and loss (`LlamaStage`, parameter names kept); a tied embedding/head has a copy at each end.
  `balance=measured` times the embedding, each block and the head on one sequence of `seq_len`.
- Recomputation: selective recomputes each attention core through the generic `Attention.attend`
  seam; `block_saved_bytes` is what one block keeps for backward in each mode (below).

Bytes saved for backward per block (what `recompute.SavedActivations` measures; fp32, e = 4 bytes
per element; s = B·T tokens on this rank, d model dim, H/K query/kv heads, h head size, f FFN dim;
the tensors autograd keeps, counted once per storage):

    none       e·(9sd + 2sKh + sH + 2s + 4sf)      # `block_saved_bytes`
      norms    2 × (x, x·rstd, its product with the weight: 3sd; rstd: s)
      attention  q: sd, k and v: 2sKh, output: sd, log-sum-exp: sH, input of wo: sd
      ffn      input of w1/w3 is the norm's output (counted above); w1·x, silu(w1·x), w3·x,
               their product (input of w2): 4sf
    selective  none − e·(sd + sH)                   # the core's output and log-sum-exp
    full       e·sd                                 # the block input

plus, once for all blocks, the RoPE tables cos and sin (T·h/2 elements each: e·T·h bytes).
Korthikanti et al. count sbh(34 + 5as/h) bytes per GPT layer in fp16 with dropout, of which
selective recomputation drops the 5as²b of the attention core's scores, softmax and dropout mask,
and full keeps 2sbh. Our block has no dropout and a flash-style core that keeps O(s) (output and
log-sum-exp) instead of O(s²), so selective drops only e·(sd + sH) here; full keeps e·sd.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.config.options import RecomputeMode
from ndtrain.dist.mesh import ParallelContext
from ndtrain.errors import UserError
from ndtrain.parallel.model.documents import packed_documents
from ndtrain.parallel.model.tensor import ColumnParallelLinear, GatherLastDim
from ndtrain.parallel.model.vocab import VocabParallelCrossEntropy
from ndtrain.parallel.model_spec import Heads, LossFn, ModelParallel, Timer

if TYPE_CHECKING:
    from ndtrain.models.llama import Llama

LLAMA_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.attention_norm": "replicate",
    "layers.*.ffn_norm": "replicate",
    "norm": "replicate",
    "output": "vocab",
}


class LlamaParallel(ModelParallel):
    """The built-in Llama's answers to tensor parallel, the pipeline cut and recomputation."""

    model: Llama

    def tp_plan(self) -> Mapping[str, str]:
        return LLAMA_PLAN

    def heads(self) -> Heads:
        cfg = self.model.cfg
        attention_type = type(self.model.layers[0].attention)  # llama.Attention, known by its instances
        return Heads(cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads, attention_type, ("wk", "wv"))

    def fit_tensor_parallel(self, ctx: ParallelContext, heads: Heads | None) -> None:
        model, output = self.model, self.model.output
        if not isinstance(output, ColumnParallelLinear):
            raise UserError("tp plan for Llama must make 'output' vocab-parallel (the loss is computed on vocab shards)")
        model.loss_fn = VocabParallelCrossEntropy(  # type: ignore[method-assign]
            output.out_start, output.out_features, ctx.comm, ctx.group("tp"))
        model.head = functools.partial(_vocab_parallel_head, model, ctx)  # type: ignore[method-assign]

    def pipeline_blocks(self, loss_fn: LossFn | None, balance: str) -> list[nn.Module]:
        return list(self.model.layers)

    def end_costs(self) -> tuple[float, float]:
        model = self.model
        last = sum(t.numel() for m in (model.norm, model.output) for t in m.parameters())
        return float(model.tok_embeddings.weight.numel()), float(last)

    def measured_costs(self, blocks: Sequence[nn.Module], timed: Timer) -> tuple[list[float], float, float]:
        model = self.model
        device = next(iter(blocks[0].parameters())).device
        tokens = torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device=device)
        first = timed(model.embed, tokens)
        x = model.embed(tokens).detach()
        cos, sin = model.rotary(torch.arange(tokens.shape[1], device=device))
        costs = [timed(lambda h, b=block: b(h, cos, sin), x) for block in blocks]
        last = timed(lambda h: model.head(h, tokens), x)
        model.zero_grad(set_to_none=True)
        return costs, first, last

    def pipeline_stage(self, block_ids: Sequence[int], first: bool, last: bool, loss_fn: LossFn | None) -> nn.Module:
        return LlamaStage(self.model, block_ids, first=first, last=last)

    def tied_weights(self) -> tuple[str, str] | None:
        return ("tok_embeddings.weight", "output.weight") if self.model.cfg.tie_embeddings else None


def _vocab_parallel_head(model: Llama | LlamaStage, ctx: ParallelContext, x: torch.Tensor,
                         targets: torch.Tensor | None) -> torch.Tensor:
    """`Llama.head` on vocab shards: the loss, or (no targets) the logits gathered to the real vocabulary."""
    logits = model.output(model.norm(x))
    if targets is not None:
        return model.loss_fn(logits, targets)
    full = GatherLastDim.apply(logits, ctx.comm, ctx.group("tp"))
    return full[..., : model.output.out_features]


class LlamaStage(nn.Module):
    """Some blocks of a Llama, with its embedding (first stage) and/or norm, head, loss (last).

    Runs the model's own `rotary`, `embed` and `head` seams (and its `loss_fn`) on itself; a seam
    a strategy replaced on the model instance (tensor parallel's head, a partial bound to the
    model) is rebound to the stage, so a parallelized model splits the same way and the rest of
    the full model can be freed."""

    def __init__(self, model: Llama, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self._seams = type(model)
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.norm, self.output = model.norm, model.output
            self.loss_fn = model.loss_fn
        for name in ("rotary", "embed", "head"):
            seam = model.__dict__.get(name)
            if isinstance(seam, functools.partial) and seam.args and seam.args[0] is model:
                seam = functools.partial(seam.func, self, *seam.args[1:], **seam.keywords)
            if seam is not None:
                setattr(self, name, seam)
        self.tied: str | None = None  # set by split_model: the name of this stage's copy of a tied embedding/head

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._seams.rotary(self, positions)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._seams.embed(self, tokens)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        return self._seams.head(self, x, targets)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens (first stage) or the activation [B, T or a sequence shard, d] → activation, or on
        the last stage the loss (the logits without targets). The sequence length is the targets'
        when given (activations may be sequence shards); `positions` as `Llama.forward`'s: [T/cp] a
        context-parallel shard's global positions, [B, T] (or a cp shard of them) per-row positions of
        packed documents, which every stage's attention keeps apart (default 0..T−1)."""
        seq = (x if targets is None else targets).shape[1]
        positions = torch.arange(seq, device=x.device) if positions is None else positions
        cos, sin = self.rotary(positions)
        documents = packed_documents(positions)
        if self.first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin, documents)
        return self.head(x, targets) if self.last else x


def block_saved_bytes(cfg: ModelConfig, tokens: int, mode: RecomputeMode, element_size: int = 4) -> int:
    """Bytes one Llama block keeps for backward for `tokens` (= B·T local) tokens, RoPE tables excluded."""
    s, d, f = tokens, cfg.dim, cfg.ffn_dim
    heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
    none = 9 * s * d + 2 * s * kv_heads * head_dim + s * heads + 2 * s + 4 * s * f
    elements = {"none": none, "selective": none - s * d - s * heads, "full": s * d}[mode]
    return element_size * elements
