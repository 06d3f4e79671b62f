"""Which sample indices each data-parallel rank reads: shuffled for training, sharded for eval.

Training (`DistributedSampler`): epoch e's global order is a permutation of range(n) drawn from
a generator seeded with seed + e (identity without shuffling), cut to a multiple of N ranks
(the last n mod N samples of the epoch are dropped, so every rank takes the same number of
steps). Rank r takes positions r, r + N, r + 2N, ... of it: consecutive groups of N form one
global batch row, so the global order does not depend on the rank count except for the cut.
The order is a pure function of (seed, epoch, rank, N); the position within the epoch is the
only state, saved as {"epoch", "consumed"}.

Evaluation (`eval_shard`): contiguous, possibly uneven shards with no padding and no
duplicates, so a sum of per-rank losses over all ranks counts every sample exactly once.
"""

from __future__ import annotations

from typing import Iterator, Sequence, overload

import torch
from torch.utils.data import Sampler

from ndtrain.errors import UserError


class EpochOrder(Sequence[int]):
    """One rank's sample indices for an epoch, held as an int64 tensor: 8 bytes per index, where a
    Python list takes ≈ 41 (44 MiB per rank at a million windows). Indexing gives an int, slicing a
    list; it compares equal to a list of the same indices."""

    def __init__(self, indices: torch.Tensor) -> None:
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.indices[index].tolist()
        return int(self.indices[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, EpochOrder)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class DistributedSampler(Sampler[int]):
    """This rank's share of a shuffled epoch, resumable mid-epoch.

    `set_epoch(e)` starts epoch e from its beginning, unless e is already the current epoch, so
    calling it after `load_state_dict` keeps the resume position. Iterating yields the rest of the
    current epoch, counting each yielded index as consumed; an iteration that starts on a fully
    consumed epoch replays it from the beginning (same order).
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 0 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"bad sampler shape: num_samples={num_samples}, rank={rank}, num_replicas={num_replicas}")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples // self.num_replicas

    def epoch_indices(self, epoch: int) -> EpochOrder:
        """This rank's indices for `epoch`, in order."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        return EpochOrder(order[: len(self) * self.num_replicas][self.rank :: self.num_replicas].clone())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def __iter__(self) -> Iterator[int]:
        if self.consumed >= len(self):
            self.consumed = 0
        for index in self.epoch_indices(self.epoch)[self.consumed :]:
            self.consumed += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["consumed"] <= len(self):
            raise UserError(
                f"saved sampler position consumed={state['consumed']} is outside this rank's {len(self)} samples per "
                "epoch: the checkpoint was written for other data or another number of data-parallel ranks"
            )
        self.epoch = state["epoch"]
        self.consumed = state["consumed"]


def eval_shard(num_samples: int, num_replicas: int, rank: int) -> range:
    """Rank r's contiguous share [r·n // N, (r+1)·n // N) of n evaluation samples."""
    return range(rank * num_samples // num_replicas, (rank + 1) * num_samples // num_replicas)
