"""Reading checkpoint files without running code from them.

A pickle can name any importable callable and call it while loading, so a crafted checkpoint
could execute code on resume, `ndtrain generate` or `ndtrain export`. Every checkpoint file is
therefore read in one of three restricted ways:

- `load_tensors`: `torch.load(weights_only=True)` — tensors, dtypes and plain containers only
  (RNG states, optimizer state dicts, sharded model dicts);
- `SafeReader`: DCP's `FileSystemReader` whose `read_metadata` unpickles `.metadata` with
  `MetadataUnpickler`, which admits only DCP's own metadata classes and the few torch/builtin
  types they hold (`.distcp` tensor items DCP already reads with `weights_only=True`);
- `SafePlanner`: DCP's `DefaultLoadPlanner` whose `load_bytes` (non-tensor items, e.g. the
  optimizer's param_groups) uses `weights_only=True` instead of DCP's `weights_only=False`.

A refused pickle raises `UnsafePickle` (a `pickle.UnpicklingError`), which the checkpoint code
turns into one line naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_CLASSES = {
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in _METADATA_CLASSES},
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): dict,
}


class UnsafePickle(pickle.UnpicklingError):
    """A pickle named something outside the allowlist."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`: its dataclasses, torch.Size, dtypes and layouts, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickle(f"refused to load {module}.{name} (not a DCP metadata type)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("refused a persistent id (DCP metadata holds none)")


def load_metadata(data: bytes) -> dcp_metadata.Metadata:
    metadata = MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafePickle(f"DCP metadata is a {type(metadata).__name__}, not Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read through `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_tensors(path: Path) -> Any:
    """A `torch.save` file of tensors and plain containers, with `weights_only=True`."""
    return torch.load(path, weights_only=True)
