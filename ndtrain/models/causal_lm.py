"""CausalLM: a transformers `*ForCausalLM` behind ndtrain's model contract.

ndtrain calls `model(tokens, targets)` with targets already shifted (targets[:, t] is the token
after tokens[:, t]) and expects one scalar loss, exactly as the built-in `Llama` does. A Hugging
Face causal LM given `labels=` shifts them again, silently training to predict the token two
ahead; this adapter never passes `labels=`. It asks the wrapped model (`self.hf`) for logits
[B, T, V] (no KV cache) and computes the mean cross-entropy over all B·T tokens once, in fp32
(float64 for a float64 model), like `Llama.loss_fn`.

Seams (attributes a strategy may replace, as on the built-in model):
- `loss_fn(logits, targets)`: tensor parallel swaps in the vocab-parallel cross-entropy;
- `full_logits(logits)`: the logits returned without targets (tensor parallel gathers vocab shards);
- `forward(..., position_ids)`: a sequence shard passes its global positions [T] or [B, T].

State-dict keys start with `hf.` (the wrapped model's keys under that prefix); exports strip it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.models.hf_parallel import HFParallel
from ndtrain.parallel.model_spec import ModelParallel
from ndtrain.parallel.precision import at_least_fp32


class CausalLM(nn.Module):
    """Tokens → logits of a transformers causal LM (`self.hf`), or the mean cross-entropy vs shifted targets."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V], or with targets [B, T] the mean cross-entropy over all B·T tokens (fp32 scalar)."""
        if position_ids is not None and position_ids.ndim == 1:
            position_ids = position_ids.unsqueeze(0).expand(tokens.shape[0], -1)
        logits = self.hf(input_ids=tokens, position_ids=position_ids, use_cache=False).logits
        return self.full_logits(logits) if targets is None else self.loss_fn(logits, targets)

    def parallel_spec(self) -> ModelParallel:
        """What the parallel strategies need to know to split this model: its family's spec (hf_parallel.py)."""
        return HFParallel(self)

    @staticmethod
    def full_logits(logits: torch.Tensor) -> torch.Tensor:
        """The logits as the caller sees them (identity on one process)."""
        return logits

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all tokens, computed in fp32 (float64 for a float64 model)."""
        return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten())
