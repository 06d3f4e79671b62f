"""CausalLM: a transformers `*ForCausalLM` behind ndtrain's model contract.

ndtrain calls `model(tokens, targets)` with targets already shifted (targets[:, t] is the token
after tokens[:, t]) and expects one scalar loss, exactly as the built-in `Llama` does. A Hugging
Face causal LM given `labels=` shifts them again, silently training to predict the token two
ahead; this adapter never passes `labels=`. It asks the wrapped model (`self.hf`) for logits
[B, T, V] (no KV cache) and computes the mean cross-entropy over all B·T tokens once, in fp32
(float64 for a float64 model), like `Llama.loss_fn`. When the model's own forward would add its MoE
router's load-balancing loss (`output_router_logits`, `router_aux_loss_coef` ≠ 0), the training loss (train
mode) adds it too (`router_loss`, models/hf_router_loss.py: recorded from the routers, reduced where a layout
spreads a forward's tokens over ranks), and the model is asked not to compute its own copy.

Seams (attributes a strategy may replace, as on the built-in model):
- `loss_fn(logits, targets)`: tensor parallel swaps in the vocab-parallel cross-entropy;
- `full_logits(logits)`: the logits returned without targets (tensor parallel gathers vocab shards);
- `forward(..., position_ids)`: a sequence shard passes its global positions [T] (shared by the rows);
  [B, T] are per-row positions, restarting at 0 where a packed document starts: transformers'
  sdpa/eager/flex masks then keep documents apart (`find_packed_sequence_indices`, no attention mask
  given), and under context parallel so does the ring (models/hf_documents.py).

State-dict keys start with `hf.` (the wrapped model's keys under that prefix); exports strip it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ndtrain.models.hf_documents import ring_documents
from ndtrain.models.hf_parallel import HFParallel
from ndtrain.models.hf_router_loss import RoutedParallel, RouterLoss
from ndtrain.parallel.model_spec import ModelParallel
from ndtrain.parallel.target_mean import mean_cross_entropy


class CausalLM(nn.Module):
    """Tokens → logits of a transformers causal LM (`self.hf`), or the mean cross-entropy vs shifted targets."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.router_loss = RouterLoss.of(hf_model)  # None: the loss is cross-entropy alone
        # the model's own router loss would be computed and dropped: ask for none (router_loss adds it)
        asked = getattr(hf_model.config, "output_router_logits", False)
        self._no_router_output = {"output_router_logits": False} if asked else {}

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V], or with targets [B, T] the mean cross-entropy over all B·T tokens (fp32 scalar),
        plus the router loss in train mode when the model adds one."""
        shared = position_ids is not None and position_ids.ndim == 1
        if shared:
            position_ids = position_ids.unsqueeze(0).expand(tokens.shape[0], -1)
        documents = ring_documents(self.hf.config, position_ids, shared)
        router = self.router_loss if targets is not None and self.training else None  # evaluation: cross-entropy
        with router.window() if router is not None else contextlib.nullcontext() as window:
            logits = self.hf(input_ids=tokens, position_ids=position_ids, use_cache=False,
                             **self._no_router_output, **documents).logits
        if targets is None:
            return self.full_logits(logits)
        loss = self.loss_fn(logits, targets)
        return loss if router is None else loss + router.loss(window, targets.numel(), logits.device)

    def parallel_spec(self) -> ModelParallel:
        """What the parallel strategies need to know to split this model: its family's spec (hf_parallel.py)."""
        return HFParallel(self) if self.router_loss is None else RoutedParallel(self, self.router_loss)

    @staticmethod
    def full_logits(logits: torch.Tensor) -> torch.Tensor:
        """The logits as the caller sees them (identity on one process)."""
        return logits

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets ≠ −100 (parallel/target_mean.py), in fp32 (float64 for a float64 model)."""
        return mean_cross_entropy(logits, targets)
