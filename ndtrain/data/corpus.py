"""Training text as token tensors: the in-memory byte corpus and the windows a trainer samples.

Where documents come from is `sources.py`; how they split into train/val and become token files is
`token_file.py`; what a run opens is `prepare.py`. `load_corpus` is the small in-memory form (bytes,
whole corpus in memory) that benchmarks and tests use: the same sources and split rule, built through
a token file in a temporary folder.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ndtrain.data.sources import open_source
from ndtrain.data.token_file import TokenReader, build_token_file
from ndtrain.data.tokenizer import ByteTokenizer, bytes_to_tensor
from ndtrain.errors import UserError


@dataclass
class Corpus:
    """The train and val splits as 1-D uint8 byte tensors, with a one-line summary for the log."""

    train: torch.Tensor
    val: torch.Tensor
    description: str
    train_documents: int
    val_documents: int


def load_corpus(path: str | None, val_fraction: float, text_field: str = "text") -> Corpus:
    """Read the documents at `path` (the standard library's source when None) as bytes and split them."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    source = open_source(path, "auto", text_field)
    with tempfile.TemporaryDirectory(prefix="ndtrain-corpus-") as folder:
        meta = build_token_file(Path(folder), source, ByteTokenizer(), val_fraction)
        train, val = ((Path(folder) / f"{split}.bin").read_bytes() for split in ("train", "val"))
    return Corpus(
        train=bytes_to_tensor(train),
        val=bytes_to_tensor(val),
        description=meta["description"],
        train_documents=meta["train_documents"],
        val_documents=meta["val_documents"],
    )


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `seq_len` inputs and their next-token targets (both int64).

    Sample i: x = data[i·seq_len : (i+1)·seq_len], y = data[i·seq_len + 1 : (i+1)·seq_len + 1];
    there are (len(data) - 1) // seq_len of them. `data` is a 1-D integer tensor or a `TokenReader`
    (a token file read window by window). `name` only labels the error message.
    """

    def __init__(self, data: torch.Tensor | TokenReader, seq_len: int, name: str = "corpus") -> None:
        if len(data) < seq_len + 1:
            unit = "bytes" if data.dtype == torch.uint8 else "tokens"
            raise UserError(
                f"the {name} has {len(data)} {unit}, too few for one window of model.seq_len={seq_len}: "
                f"it needs at least {seq_len + 1} {unit}; use more text or a smaller model.seq_len"
            )
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]
