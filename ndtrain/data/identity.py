"""Which data a run trains on: the fingerprint a checkpoint records of its token file and tokenizer.

A fingerprint is three strings taken from a token file's meta.json (token_file.py):
- `tokens`: SHA-256 over the SHA-256 of every file (tokens, document starts, loss masks) and the
  rendering (data/sft.py: kind, loss_on, length limit, packing): the samples themselves, so it changes
  with the data, the tokenizer (its spec and its files' hash), `data.val_fraction` and the fine-tuning
  settings, and not when the same files are moved or touched;
- `identity`: SHA-256 of the token file's identity (source paths, sizes and mtimes, the tokenizer's
  spec and hash, val_fraction, rendering), which `identity_digest` computes from the config without
  tokenizing: equal identities are the same data, different ones need the tokens to tell;
- `source`: the data's description, for messages.
A checkpoint saved before fingerprints existed has none: it is resumed on any data, unchecked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ndtrain.data.sft import rendering
from ndtrain.data.sources import open_source
from ndtrain.data.token_file import identity
from ndtrain.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from ndtrain.config import DataConfig

Fingerprint = dict[str, str]


def fingerprint(meta: dict[str, Any]) -> Fingerprint:
    """The fingerprint of the token file whose meta.json is `meta`."""
    tokens = _digest([meta["sha256"], meta["identity"]["rendering"]])
    return {"tokens": tokens, "identity": _digest(meta["identity"]), "source": str(meta["description"]).split("; ")[0]}


def read_fingerprint(folder: Path) -> Fingerprint | None:
    """The fingerprint of the token file in `folder` (its meta.json), None when there is none to read."""
    try:
        return fingerprint(json.loads((folder / "meta.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def identity_digest(data: DataConfig, seq_len: int) -> str:
    """The `identity` part of the fingerprint the token file of `data` has or will have: no tokenizing."""
    source = open_source(data.path, data.format, data.text_field)
    return _digest(identity(source, load_tokenizer(data.tokenizer), data.val_fraction, rendering(data, seq_len, source)))


def same_data(saved: Any, current: Fingerprint | None) -> bool:
    """Whether a checkpoint's recorded fingerprint (None or malformed: recorded before fingerprints, so
    taken as the same) and the current data's are the same tokens."""
    if not isinstance(saved, dict) or "tokens" not in saved or current is None:
        return True
    return saved["tokens"] == current["tokens"]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
