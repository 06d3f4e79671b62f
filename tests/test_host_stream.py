"""Collectives streamed through a ring of shared-memory segments (ndtrain/dist/host_stream.py), 3 real gloo processes.

A ring of 2 segments with pieces of 5 elements per rank: buffers of 3 ranges of 1, 5 and 23
elements (1, 1 and 5 rounds; 23 = 4·5 + 3, a short last round), so segments are reused many times.
Several collectives are started before any is waited for, in the order a bucket layer starts them
(reduce-scatters during backward, then gathers), and waited for in a different order: rounds run
in start order regardless. Checked against the arithmetic done here:
- `reduce_scatter_mean(read, out, s)`: `out` is the mean of this rank's range over the ranks,
  summed in the ring's order (own piece first, then the others by rank), bit-identical to that sum;
  the reader is called only for ranges inside the buffer;
- `all_gather(flat, s)`: every rank's `flat` becomes the concatenation of the ranks' own ranges;
- the counted calls and bytes: one `_shm` collective per round, (N−1)/N of the round's N·L
  elements each, so (N−1)·s elements per collective in all.
(The segments are `HostSlots.open`'s, whose files are unlinked at once: tests/test_host_slots.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.dist.host_slots import host_slots_supported
from ndtrain.dist.host_stream import SlotRing
from ndtrain.dist.mesh import init
from tests.helpers.counts import counted_since
from tests.helpers.runner import init_method, run_distributed

pytestmark = pytest.mark.skipif(not host_slots_supported(), reason="shared-memory slots need x86-64 Linux")
N = 3
PIECE = 5
SIZES = [1, 5, 23]  # elements of each rank's range


def _flat(rank: int, size: int, salt: int) -> torch.Tensor:
    return torch.randn(N * size, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * salt + 10 * size + rank))


def _streams() -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    group = ctx.group("dp")
    rank = group.rank
    ring = SlotRing.open(ctx.comm, group, torch.float64, piece=PIECE)
    assert ring is not None
    before = ctx.comm.stats.snapshot()
    reads: list[tuple[int, int]] = []
    outs, gathers, pending = {}, {}, []
    for size in SIZES:
        flat = _flat(rank, size, 0)

        def read(offset: int, into: torch.Tensor, flat: torch.Tensor = flat) -> None:
            reads.append((offset, offset + into.numel()))
            into.copy_(flat[offset : offset + into.numel()])

        outs[size] = torch.full((size,), float("nan"), dtype=torch.float64)
        pending.append(ring.reduce_scatter_mean(read, outs[size], size))
    for size in SIZES:
        gathers[size] = _flat(rank, size, 1)
        pending.append(ring.all_gather(gathers[size], size))
    for p in reversed(pending):  # waiting for a later one completes the earlier rounds first
        p.wait()
    assert all(p.done() for p in pending)
    after = ctx.comm.stats.snapshot()
    counts = {k: v for k, v in counted_since(before, after).items() if k.endswith("_shm/dp")}
    return {"outs": outs, "gathers": gathers, "counts": counts, "reads": reads}


def test_streamed_collectives_match_the_arithmetic() -> None:
    results = run_distributed(_streams, N)
    for rank, result in enumerate(results):
        for size in SIZES:
            flats = [_flat(r, size, 0) for r in range(N)]
            mean = flats[rank][rank * size : (rank + 1) * size].clone()
            for r in range(N):
                if r != rank:
                    mean += flats[r][rank * size : (rank + 1) * size]
            assert torch.equal(result["outs"][size], mean / N), (rank, size)
            gathered = torch.cat([_flat(r, size, 1)[r * size : (r + 1) * size] for r in range(N)])
            assert torch.equal(result["gathers"][size], gathered), (rank, size)
        assert all(0 <= a < b <= N * max(SIZES) for a, b in result["reads"])
        rounds = sum(-(-size // PIECE) for size in SIZES)
        moved = (N - 1) * sum(SIZES) * 8  # (N−1)/N of N·s float64 elements per collective
        expected = {"calls": rounds, "payload_bytes": N * sum(SIZES) * 8, "wire_bytes": moved}
        assert result["counts"] == {"reduce_scatter_shm/dp": expected, "all_gather_shm/dp": expected}
