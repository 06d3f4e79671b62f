"""Where training text comes from: every source is a stream of named documents, read lazily.

`open_source(path, format, text_field)`; `format = "auto"` picks by what `path` is:
- `None`: the `.py` files of this Python's standard library (`sysconfig` "stdlib" path,
  recursively, without `site-packages`), one document per file, named by relative path. Test
  trees (directories named `test`, `tests`, `idle_test`) are left out: they hold more than half
  of the bytes (≈17 MB of ≈30 MB on CPython 3.11, much of it generated fixtures and data tables),
  would triple the loading time, and the ≈12 MB that remain already exceed what the default
  run reads. Every Python ships this corpus, so the default run needs no download.
- a folder holding `dataset_info.json`, `state.json` or `dataset_dict.json` (format `disk`): a
  Hugging Face dataset written by `save_to_disk`, read with `datasets.load_from_disk` (a
  DatasetDict: its "train" split).
- any other folder (format `text`): every regular file below it, sorted, hidden files and folders
  skipped, named by relative path; files that are not valid UTF-8 are skipped and counted.
- a `.jsonl` file (format `jsonl`): one document per non-blank line, its `data.text_field` string.
- a `.parquet` file (format `parquet`): one document per row, its `data.text_field` column (pyarrow).
- any other file (format `text`): UTF-8 text, one document, read in 4 MiB chunks cut after a newline.
- formats `csv`, `json`, `arrow`: the file (or every visible file of the folder) through
  `datasets.load_dataset(format, data_files=..., streaming=True)`, one document per row.

Record documents (JSONL, Parquet, datasets) are named "line N", N counting records from 1 in file
order (for JSONL the line number: blank lines are skipped but counted). The same records in any of
these formats (a JSONL file without blank lines) therefore get the same names, hence the same split.
A record source also gives its whole records (`Source.records`, every field: what the fine-tuning
formats of sft.py read); its text documents are the records' `text_field` strings.

A path's type is checked before anything is opened: a FIFO, socket or device is refused (a FIFO
would block the reader), and one inside a folder is skipped like any non-regular file.
`fingerprint()` identifies the content cheaply: the size and mtime of every file read.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import stat
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ndtrain.errors import UserError
from ndtrain.config.options import DATA_FORMATS as FORMATS

STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})
DATASETS_BUILDERS = ("csv", "json", "arrow")
DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
CHUNK_BYTES = 4 << 20
ROW_BATCH = 1024

Document = tuple[str, Iterator[str]]  # (name, the text in one or more pieces)
Record = tuple[int, Any]  # (N of its name "line N", the record: a dict unless the file is malformed)
Records = Callable[[list[str] | None], Iterator[Record]]  # the records, of these columns only (None: all)


@dataclass
class Source:
    """A document stream. `documents()` may be iterated more than once; `description()` is complete
    (counts of skipped files) after one full iteration."""

    kind: str
    label: str
    files: Callable[[], list[Path]]
    read: Callable[["Source"], Iterator[Document]]
    skipped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    records: Records | None = None  # record formats only
    where: str = ""                 # how a record is named in messages: "'d.jsonl' line" or "'d.parquet' row"

    def documents(self) -> Iterator[Document]:
        self.skipped = 0
        return self.read(self)

    def description(self, documents: int) -> str:
        if self.kind == "folder":
            return f"{self.label} ({documents} files, {self.skipped} skipped as not UTF-8)"
        return f"{self.label} ({documents} documents)" if self.kind != "text file" else self.label

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        for file in self.files():
            info = file.stat()
            digest.update(f"{file}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
        return {"kind": self.kind, "label": self.label, "files_sha256": digest.hexdigest(), **self.extra}


def open_source(path: str | None, fmt: str = "auto", text_field: str = "text") -> Source:
    """The document source `data.path` / `data.format` / `data.text_field` describe."""
    if fmt not in FORMATS:
        raise UserError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        keep_dir = lambda d: d not in STDLIB_EXCLUDED_DIRS  # noqa: E731
        keep_file = lambda f: f.endswith(".py")  # noqa: E731
        return Source("folder", f"Python standard library source in {str(root)!r}",
                      lambda: _walk(root, keep_dir, keep_file), lambda s: _read_folder(s, root))
    target = Path(path)
    mode = _mode(target)
    is_dir = stat.S_ISDIR(mode)
    if fmt == "auto":
        if is_dir:
            fmt = "disk" if any((target / m).is_file() for m in DISK_MARKERS) else "text"
        else:
            fmt = {".jsonl": "jsonl", ".parquet": "parquet"}.get(target.suffix, "text")
    files = (lambda: _walk(target, _is_visible, _is_visible)) if is_dir else (lambda: [target])
    if fmt == "text" and is_dir:
        return Source("folder", f"folder {path!r}", files, lambda s: _read_folder(s, target))
    if fmt == "text":
        return Source("text file", f"text file {path!r}", files, lambda s: _read_text_file(target))
    if fmt == "disk" and not is_dir:
        raise UserError(f"data.format='disk' needs a folder written by save_to_disk, but {path!r} is a file")
    if is_dir and fmt in ("jsonl", "parquet"):
        raise UserError(f"data.format={fmt!r} needs a file, but {path!r} is a folder")
    records: dict[str, tuple[str, str, Records]] = {
        "disk": ("dataset", f"saved dataset {path!r}", lambda columns: _disk_records(target, columns)),
        "jsonl": ("jsonl", f"JSONL file {path!r}", lambda columns: _jsonl_records(target)),
        "parquet": ("parquet", f"Parquet file {path!r}", lambda columns: _parquet_records(target, columns)),
    }
    kind, label, read = records.get(fmt) or (
        "datasets", f"{fmt} data {path!r}", lambda columns: _builder_records(fmt, [str(f) for f in files()], path, columns))
    extra = {"text_field": text_field, **({"format": fmt} if kind == "datasets" else {})}
    return Source(kind, label, files, lambda s: _texts(s, text_field), extra=extra, records=read,
                  where=f"{path!r} {'line' if fmt == 'jsonl' else 'row'}")


def _mode(path: Path) -> int:
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
    return mode


def _walk(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> list[Path]:
    """Regular files below `root` that pass the filters, sorted by relative path."""
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if keep_dir(d)]
        found.extend(Path(folder, n) for n in names if keep_file(n) and Path(folder, n).is_file())
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def _read_folder(source: Source, root: Path) -> Iterator[Document]:
    for file in source.files():
        try:
            text = _read_bytes(file).decode("utf-8")
        except UnicodeDecodeError:
            source.skipped += 1
            continue
        yield file.relative_to(root).as_posix(), iter((text,))


def _read_text_file(path: Path) -> Iterator[Document]:
    yield path.name, _text_chunks(path)


def _text_chunks(path: Path) -> Iterator[str]:
    """The file's text in pieces of about CHUNK_BYTES, each ending after a newline (or at the end)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            rest = b""
            while chunk := f.read(CHUNK_BYTES):
                rest += chunk
                cut = rest.rfind(b"\n") + 1
                if cut:
                    yield decoder.decode(rest[:cut])
                    rest = rest[cut:]
            yield decoder.decode(rest, final=True)
    except UnicodeDecodeError:
        raise UserError(f"data.path {str(path)!r} is not UTF-8 text: give a UTF-8 text file, a folder or a .jsonl file") from None
    except OSError as e:
        raise UserError(f"cannot read {str(path)!r}: {e.strerror}; check the file's permissions") from None


def _texts(source: Source, text_field: str) -> Iterator[Document]:
    """A record source's documents: each record's `text_field` string, named "line N"."""
    assert source.records is not None
    for number, record in source.records([text_field]):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f"{source.where} {number} has no string {json.dumps(text_field)} field: every record must "
                            f'hold one, like {{{json.dumps(text_field)}: "..."}} (data.text_field names the field)')
        yield f"line {number}", iter((text,))


def _jsonl_records(path: Path) -> Iterator[Record]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {str(path)!r}: {e.strerror}; check the file's permissions") from None
    with f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.decode("utf-8"))
            except ValueError:
                raise UserError(f"{str(path)!r} line {number} is not valid UTF-8 JSON: fix or remove the line") from None


def _parquet_records(path: Path, columns: list[str] | None) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install ndtrain[hf]") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise UserError(f"data.path {str(path)!r} is not a readable Parquet file: {e}") from None
    _check_columns(table.schema_arrow.names, columns, str(path))
    rows = (row for batch in table.iter_batches(columns=columns, batch_size=ROW_BATCH) for row in batch.to_pylist())
    yield from enumerate(rows, start=1)


def _disk_records(path: Path, columns: list[str] | None) -> Iterator[Record]:
    datasets = _import_datasets()
    try:
        dataset = datasets.load_from_disk(os.fspath(path))
    except Exception as e:  # FileNotFoundError / ValueError for a folder save_to_disk did not write
        raise UserError(f"data.path {str(path)!r} is not a dataset saved with save_to_disk: {_first_line(e)}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise UserError(f"the saved DatasetDict {str(path)!r} has no 'train' split (it has {', '.join(dataset)}): "
                            "save the split to train on as a Dataset")
        dataset = dataset["train"]
    _check_columns(dataset.column_names, columns, str(path))
    if columns is not None:
        dataset = dataset.select_columns(columns)
    batches = dataset.iter(batch_size=ROW_BATCH)
    yield from enumerate((dict(zip(batch, row)) for batch in batches for row in zip(*batch.values())), start=1)


def _builder_records(builder: str, files: list[str], path: str, columns: list[str] | None) -> Iterator[Record]:
    datasets = _import_datasets()
    if not files:
        raise UserError(f"data.path {path!r} holds no files for data.format={builder!r}")
    try:
        rows = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        first = next(iter(rows.take(1)), None)
    except Exception as e:  # the builder's own errors for a file it cannot parse
        raise UserError(f"data.path {path!r} cannot be read as {builder}: {_first_line(e)}") from None
    if first is not None:
        _check_columns(list(first), columns, path)
    yield from enumerate(rows, start=1)


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError("reading Hugging Face datasets needs the datasets package: pip install ndtrain[hf]") from None
    datasets.disable_progress_bars()
    return datasets


def _check_columns(have: list[str], columns: list[str] | None, path: str) -> None:
    for column in columns or ():
        if column not in have:
            raise UserError(f"{path!r} has no column {column!r} (it has {', '.join(have)}): "
                            "set data.text_field to the text column")


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


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
