"""Packed documents: several documents in one row of a batch, told apart by their positions.

A packed row's positions restart at 0 where a document starts (a window that starts inside a
document continues that document's positions), so a document starts at token i where
positions[i] != positions[i−1] + 1 (the rule of transformers' `find_packed_sequence_indices`).
The key of a token's document is `index − position`, `index` the token's place in the whole
unsharded row: the row index its document starts at, the same for every token of that document
and different between the documents of a row (positions restart at 0, so a later document's key is
its start, larger than any earlier key). A token's key needs its own index and position only, no
scan along the row, so a sequence shard (context parallel) computes its tokens' keys locally.
Attention lets a query see a key only when both tokens have the same document key and the key is
not in the query's future.

Cost (B rows, s tokens): the keys, B·s integers; for whole-row attention one boolean mask
[B, 1, s, s], built once per forward and shared by the layers, after one device→host read per
forward that finds whether any row has a boundary at all (none: no mask, SDPA's causal fast path).
Nothing here communicates.
"""

from __future__ import annotations

import torch


def document_keys(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Document keys [B, s] of tokens at row indices `index` [s] with `positions` [B, s]."""
    return index.to(positions.device) - positions


def same_document(query_keys: torch.Tensor, key_keys: torch.Tensor) -> torch.Tensor:
    """[B, r, c]: query r and key c belong to the same document (keys [B, r] and [B, c])."""
    return query_keys[:, :, None] == key_keys[:, None, :]


class Documents:
    """The documents of a batch's rows as one forward sees them: `positions` [B, s] of the tokens this
    rank holds (whole rows, or a context-parallel shard whose attention knows the tokens' row indices)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._mask: torch.Tensor | None = None
        self._checked = False

    def causal_mask(self) -> torch.Tensor | None:
        """[B, 1, s, s] for whole rows: query i may see key j (same document, j ≤ i); None when no row
        has a boundary (the plain causal mask does). The first call reads one flag to the host."""
        if not self._checked:
            positions = self.positions
            self._checked = True
            if bool((positions[:, 1:] != positions[:, :-1] + 1).any()):
                seq = positions.shape[1]
                index = torch.arange(seq, device=positions.device)
                keys = document_keys(positions, index)
                causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
                self._mask = (same_document(keys, keys) & causal).unsqueeze(1)
        return self._mask


def packed_documents(positions: torch.Tensor) -> Documents | None:
    """The documents per-row positions [B, s] may pack; None for positions [s] shared by every row."""
    return Documents(positions) if positions.ndim == 2 else None
