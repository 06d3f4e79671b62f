"""The tiny models tests train, their batches and optimizers, and contexts built without processes.

The tiny Llama is ndtrain's `tiny` preset, seeded (seed 0): every process builds the same weights.
Batches are seeded by step, so the parent's reference and every rank draw the same global batch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ndtrain.dist.comm import Communicator, Group
from ndtrain.config import config_from_dict
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model

Batch = tuple[torch.Tensor, torch.Tensor]
GLOBAL_BATCH = 8  # sequences per step of `batch`
SEQ = 16
VOCAB = 256


def make_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny Llama (fp32 unless asked)."""
    return build_model(config_from_dict({"model": {"preset": "tiny"}}).model, seed=0).to(dtype)


def token_batch(step: int, size: int = GLOBAL_BATCH, seq: int = SEQ, vocab: int = VOCAB) -> Batch:
    """`size` random sequences of `seq` tokens seeded by `step`: (inputs, next-token targets)."""
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def batch(step: int) -> Batch:
    """The global batch of `step` (GLOBAL_BATCH sequences of SEQ tokens)."""
    return token_batch(step)


def shard(global_batch: Batch, rank: int, world: int, accumulation: int = 1) -> list[Batch]:
    """Rank `rank`'s equal share of a global batch, cut into `accumulation` micro-batches."""
    x, y = global_batch
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    return list(zip(x.chunk(accumulation), y.chunk(accumulation)))


def micro_batches(step: int, rank: int, world: int, accumulation: int) -> list[Batch]:
    """Rank `rank`'s micro-batches of the global batch of `step`."""
    return shard(batch(step), rank, world, accumulation)


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)


def fake_tp_ctx(tp: int) -> ParallelContext:
    """A context whose tp group has `tp` ranks (rank 0), without processes: for code that issues no collective."""
    group = Group("tp", tuple(range(tp)), 0)
    sizes = {"dp": 1, "cp": 1, "pp": 1, "tp": tp}
    return ParallelContext(
        rank=0, world_size=tp, local_rank=0, device=torch.device("cpu"),
        backend="gloo", sizes=sizes, coords={axis: 0 for axis in sizes}, groups={"tp": group},
        comm=Communicator(0, timedelta(seconds=1)))
