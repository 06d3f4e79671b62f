"""Token files: a corpus tokenized once into `train.*` / `val.*`, read window by window by every rank.

A cache folder holds, per split (`train`, `val`):
- `SPLIT.bin`: the token ids as native unsigned ints, uint8 when the vocabulary has ≤ 256 ids
  (bytes), uint16 up to 65536, else uint32. Every document ends with the tokenizer's end-of-sequence
  id (`eos_token`: byte 0 for bytes, an HF tokenizer's `eos_token_id`; a tokenizer without one is
  refused), unless it already ends with it or was truncated (below).
- `SPLIT.docs`: the token offset where each document starts (native int64, the first is 0).
- `SPLIT.mask`, fine-tuning data only (sft.py): one uint8 per token, 1 where the token is a target
  of the loss. An appended EOS is a target when the document's last token is.
and `meta.json`: the identity the tokens depend on (format version, the source's fingerprint: path
and size + mtime of every file, `text_field`, the tokenizer's spec and file hash, `val_fraction`,
byte order, the rendering of fine-tuning records: kind, loss_on, length limit), the dtype, token and
document counts, the SHA-256 of every file and the description.

Length limit (`Rendering.max_length`, set for fine-tuning data and for unpacked text): a document
longer than that, counting its EOS, is cut to `max_length` tokens without an EOS (`overlong =
truncate`) or left out (`drop`); a fine-tuning example left without a target token is left out too.
The description counts each.

Building streams: documents are read one at a time (a text file in 4 MiB pieces), encoded in batches
of about 1 MiB of text (fine-tuning records one by one) and appended to the split files, so memory
stays bounded whatever the corpus size (the document table, 17 bytes a document, is the only thing
that grows). Everything is written into a fresh `.building-*` folder beside the cache files and
renamed into place (meta.json last, after the old one is removed), so a reader sees a complete old
or new set and concurrent builders of the same data are harmless. Opening checks meta.json's identity
and each file's size (and, with `verify=True`, its SHA-256: the launcher does this once per run); any
mismatch, a missing or unreadable file means the cache is rebuilt. Readers (`TokenReader`) read each
window with `pread`, so a rank's resident memory holds only the windows in use, never the file.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from ndtrain.data.sft import Rendering, encode_examples
from ndtrain.data.sources import Source
from ndtrain.data.tokenizer import TORCH_DTYPES, ByteTokenizer, HFTokenizer, token_format
from ndtrain.errors import UserError

FORMAT_VERSION = 2
SPLITS = ("train", "val")
BATCH_CHARS = 1 << 20
BATCH_PIECES = 512
COPY_BYTES = 16 << 20
OFFSET = "q"  # the .docs files' int64


class TokenReader:
    """One file of a token file (tokens, document starts or mask), read range by range with `pread`
    into fresh tensors.

    `reader[a:b]` is items a..b-1 as a 1-D tensor of the file's dtype (one system call), `reader[i]`
    item i as an int; `len(reader)` the item count. The file is never loaded or mapped: the bytes read
    come from the page cache, which all ranks share, so a rank's resident memory holds only its windows.
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

    def __getitem__(self, index: slice | int) -> Any:
        if isinstance(index, int):
            if not 0 <= index < self.count:
                raise IndexError(f"item {index} out of range for {self.count} items")
            return int(self[index : index + 1][0])
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
class Split:
    """One split's readers: tokens, document starts, and the loss mask of fine-tuning data (else None)."""

    tokens: TokenReader
    docs: TokenReader
    mask: TokenReader | None


@dataclass
class TokenFile:
    """An opened cache folder: its metadata, and the readers of each split."""

    folder: Path
    meta: dict[str, Any]
    built: bool  # whether this call (re)built it

    def reader(self, split: str) -> TokenReader:
        return TokenReader(self.folder / f"{split}.bin", TORCH_DTYPES[self.meta["dtype"]], self.meta[f"{split}_tokens"])

    def split(self, split: str) -> Split:
        docs = TokenReader(self.folder / f"{split}.docs", torch.int64, self.meta[f"{split}_documents"])
        masked = self.meta["masked"]
        mask = TokenReader(self.folder / f"{split}.mask", torch.uint8, self.meta[f"{split}_tokens"]) if masked else None
        return Split(self.reader(split), docs, mask)


def file_names(masked: bool) -> list[str]:
    """The files of a token file besides meta.json."""
    return [f"{split}.{ext}" for split in SPLITS for ext in ("bin", "docs", *(("mask",) if masked else ()))]


def eos_token(tokenizer: ByteTokenizer | HFTokenizer) -> int:
    """The id that ends every document: the tokenizer's end-of-sequence token; one line when it has none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        spec = tokenizer.identity()["spec"]
        raise UserError(f"data.tokenizer={spec!r} names no end-of-sequence token, which ends every document: save it "
                        "with one (transformers' PreTrainedTokenizerFast(tokenizer_file=..., eos_token=...)"
                        ".save_pretrained(DIR)) and give data.tokenizer=hf:DIR")
    return int(eos)


def identity(source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float,
             rendering: Rendering) -> dict[str, Any]:
    """What the token ids depend on; a cache with another identity is rebuilt."""
    return {"version": FORMAT_VERSION, "source": source.fingerprint(), "tokenizer": tokenizer.identity(),
            "val_fraction": val_fraction, "byteorder": sys.byteorder, "rendering": asdict(rendering)}


def ensure_token_file(folder: Path, source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float,
                      rendering: Rendering, verify: bool = False) -> TokenFile:
    """The token file for these data in `folder`, built (or rebuilt) when missing, stale or corrupt."""
    wanted = identity(source, tokenizer, val_fraction, rendering)
    meta = read_meta(folder, wanted, verify)
    if meta is not None:
        return TokenFile(folder, meta, built=False)
    return TokenFile(folder, build_token_file(folder, source, tokenizer, val_fraction, rendering, wanted), built=True)


def read_meta(folder: Path, wanted: dict[str, Any], verify: bool) -> dict[str, Any] | None:
    """meta.json when it matches `wanted` and every file has the size (and hash) it records."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta["identity"] != wanted:
            return None
        sizes = {"bin": array(meta["dtype"]).itemsize, "docs": array(OFFSET).itemsize, "mask": 1}
        for name in file_names(meta["masked"]):
            split, ext = name.split(".")
            count = meta[f"{split}_documents" if ext == "docs" else f"{split}_tokens"]
            if (folder / name).stat().st_size != count * sizes[ext]:
                return None
            if verify and _sha256(folder / name) != meta["sha256"][name]:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def build_token_file(
    folder: Path, source: Source, tokenizer: ByteTokenizer | HFTokenizer, val_fraction: float,
    rendering: Rendering, wanted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokenize `source` into `folder` (see the module docstring); return the metadata written."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    eos = eos_token(tokenizer)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".building-", dir=folder))
    except OSError as e:
        raise UserError(f"cannot create the token cache {str(folder)!r}: {e.strerror}; set data.cache to a writable "
                        "folder") from None
    try:
        code = token_format(tokenizer.vocab_size)
        masked = rendering.kind != "text"
        writer = _SplitWriter(work, code, array(code, [eos]).tobytes(), val_fraction, masked, rendering)
        with writer:
            pieces = _text_pieces(source, tokenizer) if not masked else encode_examples(source, tokenizer, rendering)
            for key, data, mask in pieces:
                writer.add(key, data, mask)
            writer.close_document()
        if not writer.content_tokens:
            raise UserError(writer.empty_message(source))
        counts = writer.finish()
        meta: dict[str, Any] = {
            "identity": wanted if wanted is not None else identity(source, tokenizer, val_fraction, rendering),
            "dtype": code, "masked": masked, "eos": eos,
            **{f"{split}_{key}": counts[i][j] for i, split in enumerate(SPLITS) for j, key in enumerate(("tokens", "documents"))},
            "sha256": {name: _sha256(work / name) for name in file_names(masked)},
        }
        meta["description"] = (
            f"{source.description(writer.seen)}; tokenizer {tokenizer.identity()['spec']}; {writer.describe()}"
            f"train {meta['train_documents']} documents, {meta['train_tokens']:,} tokens; "
            f"val {meta['val_documents']} documents, {meta['val_tokens']:,} tokens"
        )
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
        (folder / "meta.json").unlink(missing_ok=True)
        for name in (*file_names(masked), "meta.json"):
            os.replace(work / name, folder / name)
        for name in set(file_names(True)) - set(file_names(masked)):
            (folder / name).unlink(missing_ok=True)  # a former fine-tuning token file's masks
        return meta
    except OSError as e:
        raise UserError(f"cannot write the token cache {str(folder)!r}: {e.strerror}; set data.cache to a folder with "
                        "room") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def in_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode("utf-8")) / 2**32 < val_fraction


def _text_pieces(source: Source, tokenizer: ByteTokenizer | HFTokenizer) -> Iterator[tuple[str, bytes, None]]:
    """Every piece of every document, encoded in batches: (document key, ids, no mask), in document order.
    The key is unique per document even if two share a name; "\0" parts it from the name."""
    pending: list[tuple[str, str]] = []
    chars = 0
    names = 0
    for name, pieces in source.documents():
        names += 1
        for piece in pieces:
            pending.append((f"{names}\0{name}", piece))
            chars += len(piece)
            if chars >= BATCH_CHARS or len(pending) >= BATCH_PIECES:
                yield from ((key, data, None) for (key, _), data in zip(pending, tokenizer.encode_batch([p for _, p in pending])))
                pending, chars = [], 0
    if pending:
        yield from ((key, data, None) for (key, _), data in zip(pending, tokenizer.encode_batch([p for _, p in pending])))


class _SplitWriter:
    """Appends documents (each ended by EOS) to the split files by the crc32 rule, applying the length
    limit, remembering where each one lies, and re-lays them out at the end when the fallback or the
    single-document rule applies."""

    def __init__(self, folder: Path, code: str, eos: bytes, val_fraction: float, masked: bool,
                 rendering: Rendering) -> None:
        self.folder = folder
        self.item = array(code).itemsize
        self.eos = eos
        self.val_fraction = val_fraction
        self.masked = masked
        self.limit = rendering.max_length
        self.drop = rendering.overlong == "drop"
        self.files: list[BinaryIO] = []
        self.masks: list[BinaryIO] = []
        self.written = [0, 0]  # tokens per split file
        self.documents_in = [0, 0]
        self.table_sides = array("b")
        self.table_starts = array("q")
        self.table_lengths = array("q")
        self.current: str | None = None  # the key of the document being written
        self.last = b""                  # its last token
        self.last_target = b"\x01"       # its last token's mask byte
        self.targets = 0                 # its target tokens
        self.cut = False                 # it went past the limit
        self.seen = 0                    # documents read
        self.content_tokens = 0          # tokens written besides the EOS ids
        self.truncated = self.dropped = self.untargeted = 0

    def __enter__(self) -> _SplitWriter:
        self.files = [open(self.folder / f"{split}.bin", "wb") for split in SPLITS]
        self.masks = [open(self.folder / f"{split}.mask", "wb") for split in SPLITS] if self.masked else []
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (*self.files, *self.masks):
            f.close()

    def add(self, key: str, data: bytes, mask: bytes | None) -> None:
        """Append `data` (with its mask) to the document `key`, opening it when the key is new."""
        if key != self.current:
            self.close_document()
            self.current = key
            self.seen += 1
            side = int(in_val(key.split("\0", 1)[-1], self.val_fraction))
            self.documents_in[side] += 1
            self.table_sides.append(side)
            self.table_starts.append(self.written[side])
            self.table_lengths.append(0)
            self.last, self.last_target, self.targets, self.cut = b"", b"\x01", 0, False
        if self.cut or not data:
            return
        count = len(data) // self.item
        room = count if self.limit is None else min(count, self.limit - self.table_lengths[-1])
        if room < count:
            self.cut = True
            data, mask = data[: room * self.item], None if mask is None else mask[:room]
            if not data:
                return
        self._append(data, mask)

    def close_document(self) -> None:
        """End the open document: drop it, or append its EOS (unless it ends with one or was cut)."""
        if self.current is None:
            return
        self.current = None
        length = self.table_lengths[-1]
        ends = self.last == self.eos
        self.cut = self.cut or (self.limit is not None and not ends and length + 1 > self.limit)
        if self.cut and self.drop:
            self.dropped += 1
            return self._remove_last()
        if self.masked and not self.targets:  # the EOS would not be one either: it follows a non-target
            self.untargeted += 1
            return self._remove_last()
        if not self.cut and not ends:
            self._append(self.eos, self.last_target if self.masked else None)
            self.content_tokens -= 1
        self.truncated += self.cut

    def _append(self, data: bytes, mask: bytes | None) -> None:
        side = self.table_sides[-1]
        count = len(data) // self.item
        self.files[side].write(data)
        if mask is not None:
            self.masks[side].write(mask)
            self.targets += mask.count(1)
            self.last_target = mask[-1:]
        self.written[side] += count
        self.table_lengths[-1] += count
        self.content_tokens += count
        self.last = data[-self.item :]

    def _remove_last(self) -> None:
        """Take the last document back out of its split file."""
        side, start = self.table_sides.pop(), self.table_starts.pop()
        self.content_tokens -= self.table_lengths.pop()
        for f, item in ((self.files[side], self.item), *(((self.masks[side], 1),) if self.masked else ())):
            f.seek(start * item)
            f.truncate()
        self.written[side] = start
        self.documents_in[side] -= 1

    def describe(self) -> str:
        """The limit's and the targets' counts for the description ("" when nothing was cut or left out)."""
        parts = [f"{self.truncated} truncated to {self.limit} tokens" if self.truncated else "",
                 f"{self.dropped} dropped as longer than {self.limit} tokens" if self.dropped else "",
                 f"{self.untargeted} dropped without a target token" if self.untargeted else ""]
        said = ", ".join(p for p in parts if p)
        return f"{self.seen} {'examples' if self.masked else 'documents'}: {said}; " if said else ""

    def empty_message(self, source: Source) -> str:
        if not self.masked:
            return f"data.path holds no text ({source.label}): give a non-empty text file, folder or .jsonl file"
        return (f"no example of {source.label} is left to train on ({self.describe().rstrip('; ') or 'none read'}): "
                "raise data.max_length (or model.seq_len), set data.overlong=truncate, or check data.loss_on")

    def finish(self) -> list[tuple[int, int]]:
        """Apply the single-document and fallback rules, write the .docs files; return (tokens, documents)
        per split."""
        n = len(self.table_sides)
        plan: list[list[tuple[int, int, int]]] = [[], []]  # per split: (side, start, length) of each document
        if n == 1:
            side, length = self.table_sides[0], self.table_lengths[0]
            cut = length - round(length * self.val_fraction)
            plan = [[(side, 0, cut)], [(side, cut, length - cut)]]
            self._relayout(plan)
        else:
            n_val = sum(self.table_sides)
            fallback = n_val in (0, n)
            n_val = min(n - 1, max(1, round(n * self.val_fraction))) if fallback else n_val
            for i in range(n):
                target = int(i >= n - n_val) if fallback else self.table_sides[i]
                plan[target].append((self.table_sides[i], self.table_starts[i], self.table_lengths[i]))
            if fallback:
                self._relayout(plan)
        for target, segments in enumerate(plan):
            starts = array(OFFSET, [0] * len(segments))
            for i in range(1, len(segments)):
                starts[i] = starts[i - 1] + segments[i - 1][2]
            with open(self.folder / f"{SPLITS[target]}.docs", "wb") as f:
                starts.tofile(f)
        return [(self.written[s], len(plan[s])) for s in (0, 1)]

    def _relayout(self, plan: list[list[tuple[int, int, int]]]) -> None:
        """Write new split files (and masks) from token ranges (side, start, length) of the current ones."""
        for ext, item in (("bin", self.item), *((("mask", 1),) if self.masked else ())):
            sources = [open(self.folder / f"{split}.{ext}", "rb") for split in SPLITS]
            try:
                for target, segments in enumerate(plan):
                    with open(self.folder / f"{SPLITS[target]}.new", "wb") as out:
                        for side, start, length in segments:
                            _copy_range(sources[side], out, start * item, length * item)
                    self.written[target] = sum(length for _, _, length in segments)
            finally:
                for f in sources:
                    f.close()
            for split in SPLITS:
                os.replace(self.folder / f"{split}.new", self.folder / f"{split}.{ext}")


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
