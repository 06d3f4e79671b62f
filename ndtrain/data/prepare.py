"""What a run reads: `[data]` config → tokenizer + document source → token file (built once) → windows.

Every corpus goes through a token file, small ones included (one code path; the default standard
library corpus is ≈12 MB of uint8). The cache folder is `data.cache`, by default `RUN_DIR/data`
(RUN_DIR = `log.out`). `ndtrain train` builds or verifies it once in the launcher process before any
worker starts (`check_data`: identity, sizes and SHA-256; `--check` builds into a temporary folder
instead, so it writes nothing); workers then only open it (`prepare_data`: identity and sizes
checked; windows read with pread). A `Trainer` started without the launcher (Python API) builds
it on any rank that finds it missing or stale; builds are atomic, so ranks building at once are
harmless (they only repeat the work). A shared `data.cache` holds one corpus at a time: a run
with other data, tokenizer or val_fraction rebuilds it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ndtrain.data.corpus import TokenWindows
from ndtrain.data.identity import Fingerprint, fingerprint
from ndtrain.data.sft import rendering
from ndtrain.data.sources import open_source
from ndtrain.data.token_file import TokenFile, ensure_token_file
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import UserError

if TYPE_CHECKING:
    from ndtrain.config import DataConfig, TrainConfig


@dataclass
class TokenData:
    """The train and validation windows of a run, over its opened token file."""

    train: TokenWindows
    val: TokenWindows
    file: TokenFile
    run_dir: Path

    @property
    def description(self) -> str:
        """The source and the token file, the latter named relative to the run directory when it lies there
        (keeps the run's description line short)."""
        folder = self.file.folder
        where = f"RUN_DIR/{folder.relative_to(self.run_dir)}" if folder.is_relative_to(self.run_dir) else repr(str(folder))
        return f"{self.file.meta['description']}; token file {where} ({'built' if self.file.built else 'reused'})"


def cache_folder(data: DataConfig, run_dir: str | Path) -> Path:
    return Path(data.cache) if data.cache else Path(run_dir) / "data"


def prepare_data(data: DataConfig, seq_len: int, run_dir: str | Path, verify: bool = False) -> TokenData:
    """Open (building when needed) the token file of `data` and cut both splits into samples (packed
    windows, or one padded example each: `data.packing`)."""
    tokenizer = load_tokenizer(data.tokenizer)
    source = open_source(data.path, data.format, data.text_field)
    file = ensure_token_file(cache_folder(data, run_dir), source, tokenizer, data.val_fraction,
                             rendering(data, seq_len, source), verify=verify)
    train, val = (TokenWindows(split.tokens, seq_len, name, docs=split.docs, mask=split.mask, packing=data.packing,
                               pad=file.meta["eos"])
                  for split, name in ((file.split("train"), "train"), (file.split("val"), "validation")))
    return TokenData(train, val, file, Path(run_dir))


def check_data(cfg: TrainConfig, write: bool = True) -> Fingerprint:
    """Build or verify the run's token file before workers start: both splits hold a window of
    `seq_len` + 1 tokens and train at least one global batch of windows; returns its fingerprint
    (identity.py). With `write=False` (`ndtrain train --check`) the data are tokenized into a
    temporary folder, deleted after."""
    with tempfile.TemporaryDirectory(prefix="ndtrain-check-") as scratch:
        data_cfg = cfg.data if write else dataclasses.replace(cfg.data, cache=scratch)
        data = prepare_data(data_cfg, cfg.model.seq_len, cfg.log.out, verify=True)
        windows = len(data.train)
    if windows < cfg.schedule.global_batch:
        what = f"windows of {cfg.model.seq_len + 1} tokens" if cfg.data.packing else "examples (data.packing=false)"
        raise UserError(
            f"the training data has {windows} {what}, fewer than one global "
            f"batch of {cfg.schedule.global_batch}: use more data or a smaller schedule.global_batch"
        )
    return fingerprint(data.file.meta)
