"""Training text as byte tensors: where it comes from, how it splits into train/val, and windows.

Sources (`load_corpus(path, val_fraction)`), each read as a list of named documents:
- `None`: the `.py` files of this Python's standard library (`sysconfig` "stdlib" path,
  recursively, without `site-packages`), one document per file, named by relative path. Test
  trees (directories named `test`, `tests`, `idle_test`) are left out: they hold more than half
  of the bytes (≈17 MB of ≈30 MB on CPython 3.11, much of it generated fixtures and data tables),
  would triple the loading time, and the ≈12 MB that remain already exceed what the default
  run reads. Every Python ships this corpus, so the default run needs no download.
- a `.jsonl` file: one document per non-blank line, its `"text"` string, named "line N".
- a folder: every regular file below it, sorted, hidden files and folders skipped, named by
  relative path; files that are not valid UTF-8 are skipped and counted in the description.
- any other file: UTF-8 text, one document.
A path's type is checked before anything is opened: a FIFO, socket or device is refused (a FIFO
would block the reader), and one inside a folder is skipped like any non-regular file.
`check_data` is what the launcher runs before starting workers (one extra read of the data).

Split, deterministic and independent of the order the disk lists files in: a document goes to
val when crc32(name) / 2³² < val_fraction. When that leaves either side empty although there are
at least two documents, the last round(n · val_fraction) documents (at least one, at most n - 1;
"last" in name order, or line order for JSONL) go to val instead. A single document (e.g. one
text file) splits by position: its last round(bytes · val_fraction) bytes are val, and it counts
as one document on each side. The documents of a side are joined with "\n".
"""

from __future__ import annotations

import json
import os
import stat
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import Dataset

from ndtrain.data.tokenizer import bytes_to_tensor
from ndtrain.errors import UserError

STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})

Document = tuple[str, bytes]  # (name, UTF-8 bytes)


@dataclass
class Corpus:
    """The train and val splits as 1-D uint8 byte tensors, with a one-line summary for the log."""

    train: torch.Tensor
    val: torch.Tensor
    description: str
    train_documents: int
    val_documents: int


def load_corpus(path: str | None, val_fraction: float) -> Corpus:
    """Read the documents at `path` (the standard library's source when None) and split them."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        documents, _ = _read_folder(root, lambda d: d not in STDLIB_EXCLUDED_DIRS, lambda f: f.endswith(".py"))
        source = f"Python standard library source in {str(root)!r} ({len(documents)} .py files)"
    else:
        documents, source = _read_path(Path(path))
    if not any(data for _, data in documents):
        raise UserError(f"data.path {path!r} holds no text: give a non-empty text file, folder or .jsonl file")
    train, val = _split(documents, val_fraction)
    train_bytes, val_bytes = b"\n".join(train), b"\n".join(val)
    return Corpus(
        train=bytes_to_tensor(train_bytes),
        val=bytes_to_tensor(val_bytes),
        description=(
            f"{source}; train {len(train)} documents, {len(train_bytes):,} bytes; "
            f"val {len(val)} documents, {len(val_bytes):,} bytes"
        ),
        train_documents=len(train),
        val_documents=len(val),
    )


def check_data(path: str, val_fraction: float, seq_len: int, global_batch: int) -> None:
    """What the workers will find at `path`, checked once before they start (reads the data once):
    it loads, both splits hold a window of `seq_len` + 1 bytes, train at least `global_batch` windows."""
    corpus = load_corpus(path, val_fraction)
    train = TokenWindows(corpus.train, seq_len, name="train")
    TokenWindows(corpus.val, seq_len, name="validation")
    if len(train) < global_batch:
        raise UserError(
            f"the training data has {len(train)} windows of {seq_len + 1} bytes, fewer than one global batch of "
            f"{global_batch}: use more data or a smaller schedule.global_batch"
        )


def _read_path(path: Path) -> tuple[list[Document], str]:
    try:
        mode = os.stat(path).st_mode  # the type first: opening a FIFO would block
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"data.path {str(path)!r} does not exist: give a text file, a folder or a .jsonl file") from None
    except (OSError, ValueError) as e:
        raise UserError(f"data.path {str(path)!r} cannot be used: {getattr(e, 'strerror', None) or e}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise UserError(
            f"data.path {str(path)!r} is a {_file_kind(mode)}, not a regular file: give a text file, a folder or a .jsonl file"
        )
    if stat.S_ISDIR(mode):
        documents, skipped = _read_folder(path, _is_visible, _is_visible)
        return documents, f"folder {str(path)!r} ({len(documents)} files, {skipped} skipped as not UTF-8)"
    if path.suffix == ".jsonl":
        documents = _read_jsonl(path)
        return documents, f"JSONL file {str(path)!r} ({len(documents)} documents)"
    data = _read_bytes(path)
    if not _is_utf8(data):
        raise UserError(f"data.path {str(path)!r} is not UTF-8 text: give a UTF-8 text file, a folder or a .jsonl file")
    return [(path.name, data)], f"text file {str(path)!r}"


def _read_folder(
    root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> tuple[list[Document], int]:
    """UTF-8 files below `root` sorted by relative path, and how many were skipped as not UTF-8."""
    documents: list[Document] = []
    skipped = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if keep_dir(d)]
        for name in files:
            file = Path(folder, name)
            if not keep_file(name) or not file.is_file():
                continue
            data = _read_bytes(file)
            if _is_utf8(data):
                documents.append((file.relative_to(root).as_posix(), data))
            else:
                skipped += 1
    documents.sort(key=lambda doc: doc[0])
    return documents, skipped


def _read_jsonl(path: Path) -> list[Document]:
    documents: list[Document] = []
    for number, line in enumerate(_read_bytes(path).split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:
            raise UserError(f"{str(path)!r} line {number} is not valid UTF-8 JSON: fix or remove the line") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(
                f"{str(path)!r} line {number} has no string \"text\" field: "
                'every line must be an object like {"text": "..."}'
            )
        documents.append((f"line {number}", text.encode("utf-8")))
    return documents


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "FIFO", stat.S_ISSOCK: "socket", stat.S_ISCHR: "character device",
             stat.S_ISBLK: "block device"}
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def _is_visible(name: str) -> bool:
    return not name.startswith(".")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {str(path)!r}: {e.strerror}; check the file's permissions") from None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _split(documents: list[Document], val_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """The train and val documents (see the module docstring for the rule)."""
    if len(documents) == 1:
        data = documents[0][1]
        cut = len(data) - round(len(data) * val_fraction)
        return [data[:cut]], [data[cut:]]
    in_val = [zlib.crc32(name.encode("utf-8")) / 2**32 < val_fraction for name, _ in documents]
    if all(in_val) or not any(in_val):
        n_val = min(len(documents) - 1, max(1, round(len(documents) * val_fraction)))
        in_val = [i >= len(documents) - n_val for i in range(len(documents))]
    train = [data for (_, data), val in zip(documents, in_val) if not val]
    val = [data for (_, data), val in zip(documents, in_val) if val]
    return train, val


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `seq_len` inputs and their next-byte targets (both int64).

    Sample i: x = data[i·seq_len : (i+1)·seq_len], y = data[i·seq_len + 1 : (i+1)·seq_len + 1];
    there are (len(data) - 1) // seq_len of them. `name` only labels the error message.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, name: str = "corpus") -> None:
        if len(data) < seq_len + 1:
            raise UserError(
                f"the {name} has {len(data)} bytes, too few for one window of model.seq_len={seq_len}: "
                f"it needs at least {seq_len + 1} bytes; use more text or a smaller model.seq_len"
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
