"""Training text as token tensors: the in-memory byte corpus and the samples a trainer draws.

Where documents come from is `sources.py`; how they split into train/val and become token files is
`token_file.py`; what a run opens is `prepare.py`. `load_corpus` is the small in-memory form (bytes,
whole corpus in memory) that benchmarks and tests use: the same sources and split rule, built through
a token file in a temporary folder.

A sample (`TokenWindows`) is (x, y, positions), each [T] int64 (T = seq_len): inputs, their targets
(-100 where a token is no target) and each input's position, which restarts at 0 at each document
start. Packed (`packing=True`), sample i is the window of tokens [i·T, (i+1)·T]: documents follow
each other, and the target that crosses into the next document (from a document's last token, its
EOS, to the next one's first) is -100, so a packed document's loss is that document's alone. The
document a window starts inside counts its positions from 0 at the window's start (Megatron's
reset_position_ids): positions stay below T, which a model with learned positions (GPT-2's
n_positions) needs and which keeps RoPE's fp32 angles small; rotary attention depends only on
position differences, so it sees the same document either way. Unpacked, sample i is
document i alone, right-padded to T + 1 tokens with the EOS id; padding targets are -100 and positions
run on through the padding (no attention mask needed: it lies after the real tokens). A fine-tuning
token file's mask sets every target that is not a trained token to -100 as well, and its examples are
packed whole, never cut at a window's edge (a reply cut from its prompt would be trained without the
prompt): sample i holds the next examples in file order that fit in T + 1 tokens, right-padded with
the EOS id (targets -100, positions running on), so a bin of short examples wastes its tail.
Cost per sample: three `pread`s of the window (tokens, mask) and two binary searches of the document
starts (about 2·log₂(documents) 8-byte reads); nothing of the file is held but, for fine-tuning data,
the bins (one int64 a bin), planned once from all document starts.
"""

from __future__ import annotations

import bisect
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ndtrain.data.sft import Rendering
from ndtrain.data.sources import open_source
from ndtrain.data.token_file import TokenReader, build_token_file
from ndtrain.data.tokenizer import ByteTokenizer, bytes_to_tensor
from ndtrain.errors import UserError

IGNORE = -100  # a target that is not trained on (F.cross_entropy's ignore_index)
Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Corpus:
    """The train and val splits as 1-D uint8 byte tensors (every document ended by byte 0, the byte
    tokenizer's EOS), with a one-line summary for the log."""

    train: torch.Tensor
    val: torch.Tensor
    description: str
    train_documents: int
    val_documents: int


def load_corpus(path: str | None, val_fraction: float, text_field: str = "text") -> Corpus:
    """Read the documents at `path` (the standard library's source when None) as bytes and split them."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    source = open_source(path, "auto", text_field)
    with tempfile.TemporaryDirectory(prefix="ndtrain-corpus-") as folder:
        meta = build_token_file(Path(folder), source, ByteTokenizer(), val_fraction, Rendering())
        train, val = ((Path(folder) / f"{split}.bin").read_bytes() for split in ("train", "val"))
    return Corpus(
        train=bytes_to_tensor(train),
        val=bytes_to_tensor(val),
        description=meta["description"],
        train_documents=meta["train_documents"],
        val_documents=meta["val_documents"],
    )


class TokenWindows(Dataset[Sample]):
    """The samples (x, y, positions) of one split (module docstring).

    `data`: the tokens, a 1-D integer tensor or a `TokenReader`; `docs`: each document's start offset
    (None: one document); `mask`: 1 where a token is a target (None: every one); `pad`: the id that
    pads an unpacked sample (the EOS). `name` only labels the error message.
    """

    def __init__(self, data: torch.Tensor | TokenReader, seq_len: int, name: str = "corpus", *,
                 docs: torch.Tensor | TokenReader | None = None, mask: TokenReader | None = None,
                 packing: bool = True, pad: int = 0) -> None:
        if packing and len(data) < seq_len + 1:
            unit = "bytes" if data.dtype == torch.uint8 else "tokens"
            raise UserError(
                f"the {name} has {len(data)} {unit}, too few for one window of model.seq_len={seq_len}: "
                f"it needs at least {seq_len + 1} {unit}; use more text or a smaller model.seq_len"
            )
        self.data, self.seq_len, self.mask, self.packing, self.pad = data, seq_len, mask, packing, pad
        self.docs = docs if docs is not None else torch.zeros(1, dtype=torch.int64)
        self.bins = self._pack_whole() if packing and mask is not None else None

    def __len__(self) -> int:
        if self.bins is not None:
            return len(self.bins) - 1
        return (len(self.data) - 1) // self.seq_len if self.packing else len(self.docs)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        if self.bins is not None:
            return self._bin(index)
        return self._window(index) if self.packing else self._example(index)

    def _pack_whole(self) -> torch.Tensor:
        """Fine-tuning examples packed whole, in file order: bin i holds documents docs[bins[i]:bins[i+1]],
        as many as fit in T + 1 tokens (an example is at most that long: data.max_length)."""
        starts = [*map(int, self.docs[0 : len(self.docs)]), len(self.data)]
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        if longest > self.seq_len + 1:
            raise UserError(f"an example of {longest} tokens does not fit a sample of model.seq_len={self.seq_len} + 1: "
                            "set data.max_length to at most seq_len + 1 (the token file is rebuilt)")
        bins, first = [0], 0
        for i in range(1, len(starts) - 1):
            if starts[i + 1] - starts[first] > self.seq_len + 1:
                bins.append(i)
                first = i
        bins.append(len(starts) - 1)
        return torch.tensor(bins, dtype=torch.int64)

    def _bin(self, index: int) -> Sample:
        T = self.seq_len
        first, stop = int(self.bins[index]), int(self.bins[index + 1])
        bounds = self.docs[first:stop].long().clone()
        start = int(bounds[0])
        end = int(self.docs[stop]) if stop < len(self.docs) else len(self.data)
        tokens = torch.full((T + 1,), self.pad, dtype=torch.int64)
        tokens[: end - start] = self.data[start:end].long()
        y = tokens[1:].clone()
        y[: end - start - 1] = self._masked(y[: end - start - 1], start + 1)
        y[end - start - 1 :] = IGNORE                                      # the last EOS's target and the padding
        return tokens[:-1], y, _restart_documents(y, bounds, start)

    def _window(self, index: int) -> Sample:
        T = self.seq_len
        start = index * T
        window = self.data[start : start + T + 1].long()
        y = self._masked(window[1:].clone(), start + 1)
        starts = _Starts(self.docs)
        first = bisect.bisect_right(starts, start) - 1                     # the document the window starts in
        last = bisect.bisect_right(starts, start + T)                      # documents starting up to its last target
        bounds = self.docs[first:last].long().clone()                     # (a tensor slice is a view)
        bounds[0] = start                                                  # the first one's positions start here
        return window[:-1], y, _restart_documents(y, bounds, start)

    def _example(self, index: int) -> Sample:
        T = self.seq_len
        start = int(self.docs[index])
        end = int(self.docs[index + 1]) if index + 1 < len(self.docs) else len(self.data)
        length = min(end - start, T + 1)
        tokens = torch.full((T + 1,), self.pad, dtype=torch.int64)
        tokens[:length] = self.data[start : start + length].long()
        y = tokens[1:].clone()
        y[: length - 1] = self._masked(y[: length - 1], start + 1)
        y[max(length - 1, 0):] = IGNORE
        return tokens[:-1], y, torch.arange(T)

    def _masked(self, y: torch.Tensor, offset: int) -> torch.Tensor:
        """`y` (targets of tokens offset, offset + 1, ...) with the mask's non-targets set to -100."""
        if self.mask is not None:
            y[self.mask[offset : offset + len(y)] == 0] = IGNORE
        return y


def _restart_documents(y: torch.Tensor, bounds: torch.Tensor, start: int) -> torch.Tensor:
    """The positions of a sample whose tokens start at file offset `start` and whose documents start at
    `bounds` (the first at `start`), 0 at each document's start; sets the targets that start a document
    (the previous one's last token's) in `y` to -100."""
    y[bounds[1:] - start - 1] = IGNORE
    at = torch.arange(start, start + len(y))
    return at - bounds[torch.searchsorted(bounds, at, right=True) - 1]


class _Starts:
    """Document starts as a sequence of ints that `bisect` searches, read one at a time."""

    def __init__(self, docs: torch.Tensor | TokenReader) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> int:
        return int(self.docs[i])
