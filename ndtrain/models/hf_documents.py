"""How packed documents reach a Hugging Face model's ring attention (models/hf_context.py).

transformers finds packed documents itself for its own attention implementations: with per-row
`position_ids` [B, T] and no attention mask, `create_causal_mask` (sdpa, eager, flex) masks the
pairs of different documents (`find_packed_sequence_indices`). It builds no mask for an
implementation it does not know, such as our ring, so the `CausalLM` adapter and the pipeline
stages also pass the positions down to each attention call as the keyword `document_positions`
(transformers hands a forward's extra keywords to every attention call), but only to a model that
runs the ring. Nothing communicated here; the ring's costs are in parallel/model/context.py.
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION_NAME = "ndtrain_ring"  # the ring's name in transformers' attention registry
DOCUMENTS = "document_positions"


def ring_documents(config: Any, positions: torch.Tensor | None, shared: bool) -> dict[str, torch.Tensor]:
    """The keyword that hands per-row positions [B, s] of packed documents to ring attention: none when the
    model (`config`) does not run the ring or the positions are `shared` by every row (a cp shard's global ones)."""
    if positions is None or shared or getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return {}
    return {DOCUMENTS: positions}
