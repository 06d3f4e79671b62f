"""Token files: a corpus tokenized once into `train.bin` / `val.bin`, mapped (not read) by every rank.

A cache folder holds three files:
- `train.bin`, `val.bin`: each split's token ids as native unsigned ints, uint8 when the vocabulary
  has ≤ 256 ids (bytes), uint16 up to 65536, else uint32; a split's documents are joined by the
  tokens of "\n" (for bytes exactly the old `b"\n".join(documents)`).
- `meta.json`: the identity the tokens depend on (format version, the source's fingerprint: path and
  size + mtime of every file, `text_field`, the tokenizer's spec and file hash, `val_fraction`, byte
  order), the dtype, token and document counts, the SHA-256 of each `.bin` and the description.

Building streams: documents are read one at a time (a text file in 4 MiB pieces), encoded in batches
of about 1 MiB of text and appended to the split files, so memory stays bounded whatever the corpus
size. Everything is written into a fresh `.building-*` folder beside the cache files and renamed into
place (meta.json last, after the old one is removed), so a reader sees a complete old or new set and
concurrent builders of the same data are harmless. Opening checks meta.json's identity and each
file's size (and, with `verify=True`, its SHA-256: the launcher does this once per run); any mismatch,
a missing or unreadable file means the cache is rebuilt. Readers (`TokenReader`) read each window
with `pread`, so a rank's resident memory holds only the windows in use, never the file.

Split, deterministic and independent of the order the disk lists files in: a document goes to val
when crc32(name) / 2³² < val_fraction. When that leaves either side empty although there are at
least two documents, the last round(n · val_fraction) documents (at least one, at most n - 1, in
source order) go to val instead. A single document (e.g. one text file) splits by position: its last
round(tokens · val_fraction) tokens are val, and it counts as one document on each side.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ndtrain.data.sources import Source
from ndtrain.data.tokenizer import TORCH_DTYPES, ByteTokenizer, HFTokenizer, token_format
from ndtrain.errors import UserError

FORMAT_VERSION = 1
SPLITS = ("train", "val")
BATCH_CHARS = 1 << 20
BATCH_PIECES = 512
COPY_BYTES = 16 << 20


class TokenReader:
    """One split of a token file, read window by window with `pread` into fresh tensors.

    `reader[a:b]` is tokens a..b-1 as a 1-D tensor of the file's dtype (one system call);
    `len(reader)` the token count. The file is never loaded or mapped: the bytes read come from
    the page cache, which all ranks share, so a rank's resident memory holds only its windows.
    (Mapping it with mmap was measured: each access maps the whole page-cache folio around it,
    up to 2 MiB, so 6,400 random windows made all 520 MiB of a token file resident per rank.)
    """

    def __init__(self, path: Path, dtype: torch.dtype, count: int) -> None:
        self.path = path
        self.dtype = dtype
        self.count = count
        self.item = torch.empty(0, dtype=dtype).element_size()
        self.file = open(path, "rb", buffering=0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self.count)
        if step != 1:
            raise IndexError("a token file reads contiguous ranges only")
        buffer = bytearray(max(0, stop - start) * self.item)
        if not buffer:
            return torch.empty(0, dtype=self.dtype)
        if os.preadv(self.file.fileno(), [buffer], start * self.item) != len(buffer):
            raise UserError(f"token file {str(self.path)!r} became shorter while in use: do not change data.cache "
                            "during a run; restart it to rebuild")
        return torch.frombuffer(buffer, dtype=self.dtype)


@dataclass
class TokenFile:
    """An opened cache folder: its metadata, and a reader per split."""

    folder: Path
    meta: dict[str, Any]
    built: bool  # whether this call (re)built it

    def reader(self, split: str) -> TokenReader:
        return TokenReader(self.folder / f"{split}.bin", TORCH_DTYPES[self.meta["dtype"]], self.meta[f"{split}_tokens"])


def identity(source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float) -> dict[str, Any]:
    """What the token ids depend on; a cache with another identity is rebuilt."""
    return {"version": FORMAT_VERSION, "source": source.fingerprint(), "tokenizer": tokenizer.identity(),
            "val_fraction": val_fraction, "byteorder": sys.byteorder}


def ensure_token_file(
    folder: Path, source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float, verify: bool = False
) -> TokenFile:
    """The token file for these data in `folder`, built (or rebuilt) when missing, stale or corrupt."""
    wanted = identity(source, tokenizer, val_fraction)
    meta = read_meta(folder, wanted, verify)
    if meta is not None:
        return TokenFile(folder, meta, built=False)
    return TokenFile(folder, build_token_file(folder, source, tokenizer, val_fraction, wanted), built=True)


def read_meta(folder: Path, wanted: dict[str, Any], verify: bool) -> dict[str, Any] | None:
    """meta.json when it matches `wanted` and the split files have the sizes (and hashes) it records."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta["identity"] != wanted:
            return None
        item = array(meta["dtype"]).itemsize
        for split in SPLITS:
            file = folder / f"{split}.bin"
            if file.stat().st_size != meta[f"{split}_tokens"] * item:
                return None
            if verify and _sha256(file) != meta[f"{split}_sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def build_token_file(
    folder: Path, source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float,
    wanted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokenize `source` into `folder` (see the module docstring); return the metadata written."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".building-", dir=folder))
    except OSError as e:
        raise UserError(f"cannot create the token cache {str(folder)!r}: {e.strerror}; set data.cache to a writable "
                        "folder") from None
    try:
        code = token_format(tokenizer.vocab_size)
        writer = _SplitWriter(work, code, tokenizer.encode_batch(["\n"])[0], val_fraction)
        with writer:
            _tokenize(source, tokenizer, writer)
        documents = writer.documents()
        if sum(writer.table_lengths) == 0:
            raise UserError(f"data.path holds no text ({source.label}): give a non-empty text file, folder or .jsonl file")
        counts = writer.finish()
        meta = {
            "identity": wanted if wanted is not None else identity(source, tokenizer, val_fraction),
            "dtype": code,
            **{f"{split}_{key}": counts[i][j] for i, split in enumerate(SPLITS) for j, key in enumerate(("tokens", "documents"))},
            **{f"{split}_sha256": _sha256(work / f"{split}.bin") for split in SPLITS},
        }
        meta["description"] = (
            f"{source.description(documents)}; tokenizer {tokenizer.identity()['spec']}; "
            f"train {meta['train_documents']} documents, {meta['train_tokens']:,} tokens; "
            f"val {meta['val_documents']} documents, {meta['val_tokens']:,} tokens"
        )
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
        (folder / "meta.json").unlink(missing_ok=True)
        for name in ("train.bin", "val.bin", "meta.json"):
            os.replace(work / name, folder / name)
        return meta
    except OSError as e:
        raise UserError(f"cannot write the token cache {str(folder)!r}: {e.strerror}; set data.cache to a folder with "
                        "room") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def in_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode("utf-8")) / 2**32 < val_fraction


def _tokenize(source: Source, tokenizer: ByteTokenizer | HFTokenizer, writer: _SplitWriter) -> None:
    """Encode every piece of every document in batches, appending the ids in document order."""
    pending: list[tuple[str, str]] = []  # (document name, piece); a document starts where the name changes
    chars = 0
    names = 0
    for name, pieces in source.documents():
        names += 1
        key = f"{names}\0{name}"  # unique per document even if two share a name
        for piece in pieces:
            pending.append((key, piece))
            chars += len(piece)
            if chars >= BATCH_CHARS or len(pending) >= BATCH_PIECES:
                writer.add(pending, tokenizer.encode_batch([p for _, p in pending]))
                pending, chars = [], 0
    if pending:
        writer.add(pending, tokenizer.encode_batch([p for _, p in pending]))


class _SplitWriter:
    """Appends documents to train.bin / val.bin by the crc32 rule, remembering where each one lies,
    and re-lays them out at the end when the fallback or the single-document rule applies."""

    def __init__(self, folder: Path, code: str, separator: bytes, val_fraction: float) -> None:
        self.folder = folder
        self.item = array(code).itemsize
        self.separator = separator
        self.val_fraction = val_fraction
        self.files: list[BinaryIO] = []
        self.written = [0, 0]  # tokens per split file, separators included
        self.documents_in = [0, 0]
        self.current = ""
        self.table_sides = array("b")
        self.table_starts = array("q")
        self.table_lengths = array("q")

    def __enter__(self) -> _SplitWriter:
        self.files = [open(self.folder / f"{split}.bin", "wb") for split in SPLITS]
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.files:
            f.close()

    def add(self, pieces: list[tuple[str, str]], encoded: list[bytes]) -> None:
        for (key, _), data in zip(pieces, encoded):
            if key != self.current:
                self.current = key
                side = int(in_val(key.split("\0", 1)[1], self.val_fraction))
                if self.documents_in[side]:
                    self._write(side, self.separator)
                self.documents_in[side] += 1
                self.table_sides.append(side)
                self.table_starts.append(self.written[side])
                self.table_lengths.append(0)
            side = self.table_sides[-1]
            self._write(side, data)
            self.table_lengths[-1] += len(data) // self.item

    def _write(self, side: int, data: bytes) -> None:
        self.files[side].write(data)
        self.written[side] += len(data) // self.item

    def documents(self) -> int:
        return len(self.table_sides)

    def finish(self) -> list[tuple[int, int]]:
        """Apply the single-document and fallback rules; return (tokens, documents) per split."""
        n = len(self.table_sides)
        if n == 1:
            side, length = self.table_sides[0], self.table_lengths[0]
            cut = length - round(length * self.val_fraction)
            self._relayout([[(side, 0, cut)], [(side, cut, length - cut)]], join=False)
            return [(cut, 1), (length - cut, 1)]
        n_val = sum(self.table_sides)
        if n_val in (0, n):
            n_val = min(n - 1, max(1, round(n * self.val_fraction)))
            plan: list[list[tuple[int, int, int]]] = [[], []]
            for i in range(n):
                plan[int(i >= n - n_val)].append((self.table_sides[i], self.table_starts[i], self.table_lengths[i]))
            self._relayout(plan, join=True)
        return [(self.written[s], n - n_val if s == 0 else n_val) for s in (0, 1)]

    def _relayout(self, plan: list[list[tuple[int, int, int]]], join: bool) -> None:
        """Write new split files from token ranges (side, start, length) of the current ones."""
        sources = [open(self.folder / f"{split}.bin", "rb") for split in SPLITS]
        try:
            for target, segments in enumerate(plan):
                written = 0
                with open(self.folder / f"{SPLITS[target]}.new", "wb") as out:
                    for i, (side, start, length) in enumerate(segments):
                        if join and i:
                            out.write(self.separator)
                            written += len(self.separator) // self.item
                        _copy_range(sources[side], out, start * self.item, length * self.item)
                        written += length
                self.written[target] = written
        finally:
            for f in sources:
                f.close()
        for split in SPLITS:
            os.replace(self.folder / f"{split}.new", self.folder / f"{split}.bin")


def _copy_range(source: BinaryIO, out: BinaryIO, offset: int, size: int) -> None:
    source.seek(offset)
    while size > 0:
        chunk = source.read(min(size, COPY_BYTES))
        if not chunk:
            raise OSError(0, f"token file shorter than expected while copying {source.name}")
        out.write(chunk)
        size -= len(chunk)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
