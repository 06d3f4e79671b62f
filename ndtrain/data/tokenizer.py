"""Tokenizers: text ↔ token ids. `data.tokenizer = "bytes"` (default) or `"hf:PATH"`.

- `bytes`: a token is one byte of the UTF-8 encoding (vocabulary of 256, no merges).
- `hf:PATH`: PATH a local `tokenizer.json` (read with `tokenizers.Tokenizer.from_file`) or a local
  transformers tokenizer directory (`AutoTokenizer.from_pretrained(PATH, local_files_only=True)`).
  Nothing is downloaded. Text is encoded without special tokens (no BOS/EOS added); the vocabulary
  size is the largest id + 1, added tokens included. Needs `pip install ndtrain[hf]`.

A transformers tokenizer directory may name an end-of-sequence token and a chat template
(`eos_token_id`, `chat_template`, `render_chat`: what `ndtrain generate` stops at and `--chat` renders);
a tokenizer.json has neither. The byte tokenizer's end-of-sequence token is byte 0 (NUL), which text
practically never holds: token files end every document with it (token_file.py), and the vocabulary
stays 256, so token files stay uint8 and the default model keeps its size. It has no chat template.

`identity()` names what the token ids depend on (the spec and a hash of the tokenizer's files; in a
model folder its weight files are left out), so a token file built with one tokenizer is never read
with another.

A model folder's own tokenizer (`folder_tokenizer`): the folder has one when it holds a tokenizer
file AutoTokenizer reads (tokenizer.json, tokenizer_config.json, a vocabulary); when that tokenizer
is ndtrain's byte tokenizer in HF form (`byte_level_tokenizer`, what `ndtrain export --format hf`
writes for a byte run: ids 0..255 = the UTF-8 bytes) its spec is `bytes`. `token_unit` names what
one token is, for the loss's unit (nats per byte or per token).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ndtrain.errors import UserError

HF_PREFIX = "hf:"
# files AutoTokenizer reads a tokenizer from; a folder holding one of them has a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
# weight files of a model folder: not part of its tokenizer's identity (and too large to hash at each start)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class Tokenizer(Protocol):
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        """Each text's ids packed as native unsigned ints of `token_format(vocab_size)` (see below)."""

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...

    def identity(self) -> dict[str, str]: ...

    def save_pretrained(self, folder: Path) -> None:
        """Write the tokenizer into `folder` as transformers' `save_pretrained` does (AutoTokenizer reads it)."""


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
    eos_token_id = 0  # NUL (module docstring)
    chat_template = None

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

    def save_pretrained(self, folder: Path) -> None:
        """`byte_level_tokenizer` as a transformers fast tokenizer: the same ids for every text."""
        fast = _transformers_module("saving the byte tokenizer").PreTrainedTokenizerFast
        fast(tokenizer_object=byte_level_tokenizer()).save_pretrained(os.fspath(folder))


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

    @property
    def eos_token_id(self) -> int | None:
        """A transformers tokenizer's end-of-sequence id; None for a tokenizer.json (it names none)."""
        return None if self._transformers is None else self._transformers.eos_token_id

    @property
    def chat_template(self) -> str | None:
        """A transformers tokenizer's chat template (Jinja); None without one or for a tokenizer.json."""
        template = getattr(self._transformers, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The messages as the chat template writes them, by default ending with the assistant's turn opened."""
        try:
            return self._transformers.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False)
        except Exception as e:  # jinja2's errors and transformers' ValueError: the template is the user's
            raise UserError(f"the chat template of data.tokenizer={self.spec!r} does not render "
                            f"({_first_line(e)}): fix it in tokenizer_config.json") from None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """A transformers tokenizer's ids of `text` (no special tokens added, as `apply_chat_template`
        tokenizes) and the character offset where each token starts."""
        try:
            encoded = self._transformers(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise UserError(f"data.tokenizer={self.spec!r} is a slow tokenizer, which gives no character offsets: "
                            "save it as a fast one (tokenizer.json)") from None
        return encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]

    def save_pretrained(self, folder: Path) -> None:
        """A transformers tokenizer's own `save_pretrained`; a tokenizer.json wrapped as a fast tokenizer."""
        tokenizer = self._transformers
        if tokenizer is None:
            fast = _transformers_module(f"data.tokenizer={self.spec!r}").PreTrainedTokenizerFast
            tokenizer = fast(tokenizer_object=self._fast)
        tokenizer.save_pretrained(os.fspath(folder))

    def tokenizer_json(self) -> str | None:
        """The tokenizer as `tokenizers`' JSON (what `Tokenizer.from_str` reads); None for a transformers
        tokenizer without a `tokenizers` backend."""
        backend = self._fast if self._fast is not None else getattr(self._transformers, "backend_tokenizer", None)
        return None if backend is None else backend.to_str()

    def identity(self) -> dict[str, str]:
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and not _is_weights(p)) \
            if self.path.is_dir() else [self.path]
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


def token_unit(spec: str) -> str:
    """What one token of the tokenizer `spec` is: "byte" for the byte tokenizer, else "token"."""
    return "byte" if spec == "bytes" else "token"


def folder_tokenizer(folder: Path) -> str | None:
    """The `data.tokenizer` spec of a model folder's own tokenizer: None when it holds no tokenizer file,
    `bytes` when its tokenizer is ndtrain's byte tokenizer (`byte_level_tokenizer`), else `hf:FOLDER`."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return "bytes" if _is_byte_level(folder / "tokenizer.json") else f"{HF_PREFIX}{folder}"


def byte_chars() -> list[str]:
    """The character standing for each byte 0..255 in a byte-level BPE vocabulary (GPT-2's mapping, which
    `tokenizers`' ByteLevel pre-tokenizer applies): printable Latin-1 bytes stand for themselves, the
    others for U+0100 onwards in byte order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_level_tokenizer() -> Any:
    """ndtrain's byte tokenizer as a `tokenizers.Tokenizer`: a byte-level BPE with no merges whose id of
    each byte is the byte's value, no prefix space, no normalizer, no special tokens; decoding joins the
    bytes back (invalid UTF-8 becomes U+FFFD, as `ByteTokenizer.decode`)."""
    tokenizers = _tokenizers_module("the byte tokenizer in Hugging Face form")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: b for b, c in enumerate(byte_chars())}, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def _is_byte_level(file: Path) -> bool:
    """Whether `file` is a tokenizer.json encoding text without special tokens to ndtrain's byte ids: no
    added tokens nor normalizer, a ByteLevel pre-tokenizer without prefix space or regex split, a BPE of
    the 256 byte characters at their byte values and no merges (read as JSON, nothing imported)."""
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(saved, dict) or not isinstance(saved.get("pre_tokenizer"), dict) \
            or not isinstance(saved.get("model"), dict):
        return False
    pre, model = saved["pre_tokenizer"], saved["model"]
    return (not saved.get("added_tokens") and saved.get("normalizer") is None
            and (pre.get("type"), pre.get("add_prefix_space"), pre.get("use_regex", True))
            == ("ByteLevel", False, False)
            and model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == {c: b for b, c in enumerate(byte_chars())})


def _is_weights(file: Path) -> bool:
    return file.name.endswith(WEIGHT_SUFFIXES)


def _tokenizers_module(purpose: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise UserError(f"{purpose} needs the tokenizers package: pip install ndtrain[hf]") from None
    return tokenizers


def _load_tokenizers(path: Path, spec: str) -> Any:
    tokenizers = _tokenizers_module(f"data.tokenizer={spec!r}")
    try:
        return tokenizers.Tokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises its own Exception type for any bad file
        raise UserError(f"data.tokenizer={spec!r} is not a readable tokenizer.json ({_first_line(e)}): "
                        "give a file saved by tokenizers' Tokenizer.save") from None


def _transformers_module(purpose: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(f"{purpose} needs the transformers package: pip install ndtrain[hf]") from None
    return transformers


def _load_transformers(path: Path, spec: str) -> Any:
    auto = _transformers_module(f"data.tokenizer={spec!r}").AutoTokenizer
    try:
        return auto.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad directory
        raise UserError(f"data.tokenizer={spec!r} is not a readable tokenizer directory ({_first_line(e)}): "
                        "give a directory written by a tokenizer's save_pretrained") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
