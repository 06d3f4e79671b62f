"""Byte-level tokenizer: a token is one byte of the UTF-8 encoding (vocabulary of 256, no merges)."""

from __future__ import annotations

from typing import Sequence

import torch


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    """A writable uint8 tensor holding `data` (empty input gives an empty tensor)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of `text` as a uint8 tensor."""
        return bytes_to_tensor(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text from byte ids; invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(values).decode("utf-8", errors="replace")
