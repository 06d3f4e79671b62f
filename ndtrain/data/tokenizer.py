"""Tokenizers: text ↔ token ids. `data.tokenizer = "bytes"` (default) or `"hf:PATH"`.

- `bytes`: a token is one byte of the UTF-8 encoding (vocabulary of 256, no merges).
- `hf:PATH`: PATH a local `tokenizer.json` (read with `tokenizers.Tokenizer.from_file`) or a local
  transformers tokenizer directory (`AutoTokenizer.from_pretrained(PATH, local_files_only=True)`).
  Nothing is downloaded. Text is encoded without special tokens (no BOS/EOS added); the vocabulary
  size is the largest id + 1, added tokens included. Needs `pip install ndtrain[hf]`.

`identity()` names what the token ids depend on (the spec and a hash of the tokenizer's files), so
a token file built with one tokenizer is never read with another.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ndtrain.errors import UserError

HF_PREFIX = "hf:"


class Tokenizer(Protocol):
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        """Each text's ids packed as native unsigned ints of `token_format(vocab_size)` (see below)."""

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...

    def identity(self) -> dict[str, str]: ...


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    """A writable uint8 tensor holding `data` (empty input gives an empty tensor)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def token_format(vocab_size: int) -> str:
    """The `array` type code of the smallest unsigned int holding ids below `vocab_size`:
    B (uint8) up to 256, H (uint16) up to 65536, else I (uint32)."""
    if vocab_size <= 2**8:
        return "B"
    return "H" if vocab_size <= 2**16 else "I"


TORCH_DTYPES = {"B": torch.uint8, "H": torch.uint16, "I": torch.uint32}


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of `text` as a uint8 tensor."""
        return bytes_to_tensor(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        return [text.encode("utf-8") for text in texts]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text from byte ids; invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(values).decode("utf-8", errors="replace")

    def identity(self) -> dict[str, str]:
        return {"spec": "bytes"}


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a tokenizer.json) or a transformers tokenizer (from a directory)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.path = Path(spec[len(HF_PREFIX):])
        if not self.path.exists():
            raise UserError(f"data.tokenizer={spec!r}: {str(self.path)!r} does not exist; give a tokenizer.json "
                            "file or a transformers tokenizer directory")
        self._fast: Any = None
        self._transformers: Any = None
        if self.path.is_dir():
            self._transformers = _load_transformers(self.path, spec)
            vocab = self._transformers.get_vocab()
        else:
            self._fast = _load_tokenizers(self.path, spec)
            vocab = self._fast.get_vocab(with_added_tokens=True)
        if not vocab:
            raise UserError(f"data.tokenizer={spec!r} has an empty vocabulary: give a trained tokenizer")
        self.vocab_size = max(vocab.values()) + 1
        self._code = token_format(self.vocab_size)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return self._transformers(texts, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        from array import array

        return [array(self._code, ids).tobytes() for ids in self._ids(texts)]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._ids([text])[0], dtype=torch.int64)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self._fast is not None:
            return self._fast.decode(values, skip_special_tokens=False)
        return self._transformers.decode(values, skip_special_tokens=False)

    def identity(self) -> dict[str, str]:
        files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return {"spec": self.spec, "sha256": digest.hexdigest()}


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `data.tokenizer` names."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith(HF_PREFIX) and spec[len(HF_PREFIX):].strip():
        return HFTokenizer(spec)
    raise UserError(f"data.tokenizer={spec!r} is not 'bytes' or 'hf:PATH' (a tokenizer.json or a tokenizer directory)")


def tokenizer_vocab_size(spec: str) -> int:
    """The vocabulary size of the tokenizer `spec` names (256 for bytes, without loading anything)."""
    return ByteTokenizer.vocab_size if spec == "bytes" else load_tokenizer(spec).vocab_size


def _load_tokenizers(path: Path, spec: str) -> Any:
    try:
        from tokenizers import Tokenizer as FastTokenizer
    except ImportError:
        raise UserError(f"data.tokenizer={spec!r} needs the tokenizers package: pip install ndtrain[hf]") from None
    try:
        return FastTokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises its own Exception type for any bad file
        raise UserError(f"data.tokenizer={spec!r} is not a readable tokenizer.json ({_first_line(e)}): "
                        "give a file saved by tokenizers' Tokenizer.save") from None


def _load_transformers(path: Path, spec: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"data.tokenizer={spec!r} needs the transformers package: pip install ndtrain[hf]") from None
    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad directory
        raise UserError(f"data.tokenizer={spec!r} is not a readable tokenizer directory ({_first_line(e)}): "
                        "give a directory written by a tokenizer's save_pretrained") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
