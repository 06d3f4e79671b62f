"""An `hf:PATH` folder's weight files, checked by the launcher before any worker starts.

The workers load `model.safetensors` (or the shards a `model.safetensors.index.json` names) with
`from_pretrained`; what would fail there, on every rank and again after every restart, or silently
start from random weights, is refused here in one line:
- a folder whose only weights are pickled (`pytorch_model.bin`, or its sharded index): ndtrain never
  unpickles, and never replaces the user's model by random weights; the message says how to convert;
- a file whose header is not a safetensors header: shorter than 8 bytes, a header length beyond the
  file (e.g. 2^62), a header that is not a JSON table of tensors, or a file size other than the one its
  header describes (a truncated copy, trailing bytes); whatever else the safetensors library refuses;
- a tensor whose shape is not the one the config's model has for that name (the model built on the
  meta device: `hf._meta_model`), a floating-point parameter stored as integers, or a parameter of the
  model no file holds (it would start random). Tied parameters count once.
Only the headers are read (a few KB per file), never the tensors.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from ndtrain.errors import UserError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
DTYPE_BYTES = {**FLOAT_DTYPES, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2,
               "I32": 4, "U32": 4, "I64": 8, "U64": 8}
SHOWN = 3  # missing names a refusal lists
Header = dict[str, tuple[str, list[int]]]  # tensor name → (dtype, shape)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files `from_pretrained` would read in PATH ([] when none); a folder whose only weights
    are pickled is refused, naming how to convert them."""
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    if (path / SAFETENSORS_INDEX).is_file():
        return _index_shards(path)
    pickled = [name for name in PICKLED if (path / name).is_file()]
    if pickled:
        raise UserError(
            f"--model hf:{path}: its only weights are pickled ({pickled[0]}), which ndtrain never unpickles: convert "
            f"them to safetensors once, if you trust the file, with python -c \"from transformers import "
            f"AutoModelForCausalLM as M; M.from_pretrained('{path}').save_pretrained('{path}')\", or remove "
            f"{pickled[0]} to start from random weights"
        )
    return []


def check_hf_weights(path: Path, model: torch.nn.Module) -> None:
    """Refuse (one line) weight files of PATH that `model` (the config's model, any device) cannot load whole."""
    header: Header = {}
    for file in weight_files(path):
        header.update(read_header(file))
    if not header:
        return
    expected = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "")
    found: set[str] = set()
    for name, (dtype, shape) in header.items():
        key = name if name in expected else f"{prefix}.{name}"
        if key not in expected:
            continue  # transformers ignores names its model does not have, so do we
        found.add(key)
        tensor = expected[key]
        if list(tensor.shape) != shape:
            raise UserError(f"--model hf:{path}: {name!r} has shape {shape} in the weights, the model of config.json "
                            f"has {list(tensor.shape)}: the weights belong to another config")
        if tensor.is_floating_point() and dtype not in FLOAT_DTYPES:
            raise UserError(f"--model hf:{path}: {name!r} is stored as {dtype}, the model expects floating point "
                            f"({', '.join(FLOAT_DTYPES)})")
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = [names[0] for names in aliases.values() if not found.intersection(names)]
    if missing:
        shown = ", ".join(map(repr, missing[:SHOWN])) + (", ..." if len(missing) > SHOWN else "")
        raise UserError(f"--model hf:{path}: the weights lack {len(missing)} parameter(s) of the model of config.json "
                        f"({shown}), which would start random: give the weights saved with this config")


def read_header(file: Path) -> Header:
    """Tensor name → (dtype, shape) of a safetensors file, its header checked against the file's size."""
    with open(file, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size < 8:
            raise _bad(file, f"it has {size} bytes, fewer than a header's 8")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, MAX_HEADER):
            raise _bad(file, f"its header length {length} exceeds the file's {size} bytes")
        try:
            table = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _bad(file, "its header is not JSON") from None
    if not isinstance(table, dict):
        raise _bad(file, "its header is not a table of tensors")
    header: Header = {}
    end = 0
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        except (TypeError, KeyError, ValueError):
            raise _bad(file, f"its header entry {name!r} is not a tensor (dtype, shape, data_offsets)") from None
        if not 0 <= start <= stop or stop - start != nbytes:
            raise _bad(file, f"tensor {name!r} ({dtype} {shape}) takes {nbytes} bytes, its offsets {start}..{stop} disagree")
        header[name] = (dtype, shape)
        end = max(end, stop)
    described = 8 + length + end
    if described != size:
        what = "truncated" if size < described else "followed by bytes that are not its"
        raise _bad(file, f"it has {size} bytes where its header describes {described}: it is {what}")
    _library_check(file)
    return header


def _library_check(file: Path) -> None:
    """Whatever else the safetensors library refuses in the file (it reads the header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except SafetensorError as e:
        raise _bad(file, str(e)) from None


def _index_shards(path: Path) -> list[Path]:
    """The shard files of a sharded safetensors index: plain names inside PATH, each present."""
    index = path / SAFETENSORS_INDEX
    try:
        weight_map: Any = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"--model hf:{path}: cannot read {SAFETENSORS_INDEX} ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"--model hf:{path}: {SAFETENSORS_INDEX} has no weight_map of tensor → file names")
    shards = []
    for name in sorted(set(weight_map.values())):
        if Path(name).name != name or not (path / name).is_file():
            raise UserError(f"--model hf:{path}: {SAFETENSORS_INDEX} names {name!r}, which is not a file in the folder")
        shards.append(path / name)
    return shards


def _bad(file: Path, problem: str) -> UserError:
    return UserError(f"--model hf:{file.parent}: {file.name} is not a safetensors file ndtrain can load: {problem}")
