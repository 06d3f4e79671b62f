"""Shared-memory slots (ndtrain/dist/host_slots.py) between real gloo worker processes.

- 3 ranks (chunks of unequal use, one empty where numel < N): all-reduce, reduce-scatter and an
  all-gather by `exchange` (each rank reading the owners' chunks) against the arithmetic done here, every rank bit-identical, for float32 and float64
  and sizes 1 to 100,003, repeated on one segment with new data (sequence numbers advance); the
  exact counted bytes; no segment file is left behind.
- `cut`s of one segment (other sizes and chunks, sharing its sequence numbers), one after the other:
  each reduce-scatter averages this rank's part of the cut only.
- Ranks that cannot map one segment (a rank with a /dev/shm of its own, as on another host) get
  None on every rank, so they keep the backend's collectives alike.
- A rank that stops (real SIGSTOP) before it arrives is named by the watchdog of the rank waiting in
  the shared-memory collective, as for any collective.
- A rank that ends (real SIGKILL, or an exit) before it arrives ends the survivor's wait at once, long
  before the watchdog, with one line naming it that the failure rule takes for a lost peer; peers in
  another PID namespace, or not shown by /proc as recorded, are not checked.
- `ZeroOptimizer` over a plain DDP whose buckets are slots (cut at cache lines, not at the
  optimizer's ranges) trains as over gloo: it gathers through a ring only over ZeRO-1's own
  buckets (dist/host_stream.py); gathering through a plain DDP's slots once made every parameter wrong.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.dist import host_slots
from ndtrain.dist.host_slots import HostSlots, host_slots_supported
from ndtrain.dist.mesh import init
from ndtrain.dist.procfs import proc_stat
from ndtrain.failures import lost_peer
from tests.helpers.counts import counted_since
from tests.helpers.runner import init_method, run_distributed

pytestmark = pytest.mark.skipif(not host_slots_supported(), reason="shared-memory slots need x86-64 Linux")
SIZES = [(1, torch.float64), (37, torch.float64), (100_003, torch.float32)]
ROUNDS = 3


def _data(rank: int, numel: int, dtype: torch.dtype, round_: int) -> torch.Tensor:
    return torch.randn(numel, dtype=dtype, generator=torch.Generator().manual_seed(1000 * round_ + rank))


def _collectives(directory: str) -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    group = ctx.group("dp")
    out: dict[str, Any] = {}
    for numel, dtype in SIZES:
        slots = HostSlots.open(ctx.comm, group, numel, dtype, directory=Path(directory))
        assert slots is not None
        before = ctx.comm.stats.snapshot()
        for round_ in range(ROUNDS):
            slots.mine.copy_(_data(group.rank, numel, dtype, round_))
            slots.all_reduce_mean().wait()
            out[f"all_reduce {numel} {round_}"] = slots.mine.clone()
            slots.mine.copy_(_data(group.rank, numel, dtype, round_))
            pending = slots.reduce_scatter_mean()
            while not pending.done():  # the non-blocking path the bucket layer polls
                pass
            pending.wait()
            out[f"reduce_scatter {numel} {round_}"] = slots.mine.clone()
            values = _data(group.rank, numel, dtype, round_ + 100)
            slots.mine.copy_(values)

            def pull(values: torch.Tensor = values) -> None:  # exchange: an all-gather read from the owners' slots
                for k, (a, b) in enumerate(slots.chunks):
                    if k != group.rank:
                        values[a:b].copy_(slots.slots[k, a:b])

            slots.exchange("all_gather", pull).wait()
            out[f"all_gather {numel} {round_}"] = values
        after = ctx.comm.stats.snapshot()
        out[f"counts {numel}"] = {k: v for k, v in counted_since(before, after).items() if k.endswith("_shm/dp")}
        out[f"chunks {numel}"] = slots.chunks
    out["cuts"] = _cuts(ctx, directory)
    out["left"] = os.listdir(directory)
    return out


CUTS = [(37, 13), (100, 40), (10, 4), (37, 13)]  # (numel, chunk) of successive collectives on one segment of 100


def _cuts(ctx: Any, directory: str) -> list[torch.Tensor]:
    """Reduce-scatters on cuts of different sizes and chunks of one segment, one after the other (ZeRO-2's
    buckets taking turns): each rank's slot after each."""
    segment = HostSlots.open(ctx.comm, ctx.group("dp"), 100, torch.float64, directory=Path(directory))
    assert segment is not None
    with pytest.raises(ValueError, match="does not fit"):
        segment.cut(101, 34)
    out = []
    for round_, (numel, chunk) in enumerate(CUTS):
        cut = segment.cut(numel, chunk)
        cut.mine.copy_(_data(ctx.group("dp").rank, numel, torch.float64, round_))
        cut.reduce_scatter_mean().wait()
        out.append(segment.mine.clone())
    return out


def test_collectives_match_the_arithmetic_on_every_rank() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        results = run_distributed(_collectives, 3, directory)
    n = 3
    for numel, dtype in SIZES:
        chunks = results[0][f"chunks {numel}"]
        assert chunks[0][0] == 0 and chunks[-1][1] == numel and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        for round_ in range(ROUNDS):
            data = [_data(r, numel, dtype, round_) for r in range(n)]
            mean = torch.stack(data).to(torch.float64).sum(0) / n
            for rank, out in enumerate(results):
                got = out[f"all_reduce {numel} {round_}"]
                assert torch.equal(got, results[0][f"all_reduce {numel} {round_}"])  # bit-identical replicas
                torch.testing.assert_close(got.to(torch.float64), mean, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=1e-7)
                lo, hi = chunks[rank]
                scattered = out[f"reduce_scatter {numel} {round_}"]
                assert torch.equal(scattered[lo:hi], got[lo:hi])  # this rank's chunk: the mean, the same bits
                outside = torch.ones(numel, dtype=torch.bool)
                outside[lo:hi] = False
                assert torch.equal(scattered[outside], data[rank][outside])  # the rest untouched
                gathered = torch.cat([_data(k, numel, dtype, round_ + 100)[a:b] for k, (a, b) in enumerate(chunks)])
                assert torch.equal(out[f"all_gather {numel} {round_}"], gathered)
        size = numel * dtype.itemsize
        moved = (n - 1) * size // n
        for out in results:
            assert out[f"counts {numel}"] == {
                "all_reduce_shm/dp": {"calls": ROUNDS, "payload_bytes": ROUNDS * size, "wire_bytes": ROUNDS * 2 * moved},
                "reduce_scatter_shm/dp": {"calls": ROUNDS, "payload_bytes": ROUNDS * size, "wire_bytes": ROUNDS * moved},
                "all_gather_shm/dp": {"calls": ROUNDS, "payload_bytes": ROUNDS * size, "wire_bytes": ROUNDS * moved},
            }
    assert results[0][f"chunks {SIZES[0][0]}"][1:] == [(1, 1), (1, 1)]  # numel 1: two ranks own nothing
    for rank, out in enumerate(results):  # cuts of one segment: this rank's part of each averaged, the rest as written
        for round_, ((numel, chunk), got) in enumerate(zip(CUTS, out["cuts"])):
            data = [_data(r, numel, torch.float64, round_) for r in range(n)]
            lo, hi = min(numel, rank * chunk), min(numel, (rank + 1) * chunk)
            want = data[rank].clone()
            want[lo:hi] = sum(d[lo:hi] for d in data) / n
            torch.testing.assert_close(got[:numel], want, rtol=1e-14, atol=1e-15)
    assert all(out["left"] == [] for out in results)  # the segments were unlinked once mapped


def _split_hosts(directories: list[str]) -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    group = ctx.group("dp")
    own = HostSlots.open(ctx.comm, group, 64, torch.float32, directory=Path(directories[group.rank]))
    shared = HostSlots.open(ctx.comm, group, 64, torch.float32, directory=Path(directories[0]))
    return {"own": own is None, "shared": shared is not None, "left": sorted(os.listdir(directories[group.rank]))}


def test_ranks_that_cannot_map_one_segment_all_keep_the_backend() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as a, tempfile.TemporaryDirectory(dir="/dev/shm") as b:
        results = run_distributed(_split_hosts, 2, [a, b])
    assert [r["own"] for r in results] == [True, True]  # rank 1 looked in its own directory: nobody uses slots
    assert [r["shared"] for r in results] == [True, True]
    assert [r["left"] for r in results] == [[], []]


def _stops_before_arriving(watchdog_s: float) -> None:
    ctx = init(ParallelConfig(watchdog_s=watchdog_s, timeout_s=120), init_method=init_method())
    slots = HostSlots.open(ctx.comm, ctx.group("dp"), 1000, torch.float32)
    assert slots is not None
    slots.all_reduce_mean().wait()  # everyone arrives once
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    slots.all_reduce_mean().wait()


def test_a_rank_stopped_before_a_shared_memory_collective_is_named(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="exited with status 1"):
        run_distributed(_stops_before_arriving, 2, 2.0, timeout=60)
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1, errors
    assert re.fullmatch(
        r"ndtrain: error: rank 0 waited \d+ s in collective #\d+ all_reduce_shm on axis 'dp' \(ranks \[0, 1\]\); "
        r"ranks \[1\] did not arrive \(rank 1: last seen \d+ s ago at #\d+ on axis 'dp', its process is stopped "
        r"\(SIGSTOP\), so killed\)",
        errors[0],
    ), errors[0]


def _ends_before_arriving(how: str) -> None:
    """Rank 1 ends (SIGKILL or a plain exit) after one collective; rank 0 waits in the next one and
    prints, in one line, what ended its wait (the watchdog, at 60 s, is far off)."""
    ctx = init(ParallelConfig(watchdog_s=60, timeout_s=120), init_method=init_method())
    slots = HostSlots.open(ctx.comm, ctx.group("dp"), 1000, torch.float32)
    assert slots is not None
    slots.all_reduce_mean().wait()  # everyone arrives once
    if ctx.rank == 1 and how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx.rank == 1:
        os._exit(0)
    try:
        slots.all_reduce_mean().wait()
    except RuntimeError as error:
        print(f"survivor: lost_peer={lost_peer(error)} {error}", file=sys.stderr, flush=True)
        raise


@pytest.mark.parametrize("how", ["killed", "exits"])
def test_a_rank_that_ends_before_a_shared_memory_collective_fails_the_wait(
        how: str, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError) as failed:  # rank 0's error, or rank 1's death, whichever the runner sees first
        run_distributed(_ends_before_arriving, 2, how, timeout=60)
    assert "did not finish" not in str(failed.value), failed.value  # nobody hung
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("survivor:")]
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"survivor: lost_peer=True collective #\d+ all_reduce_shm on axis 'dp' \(ranks \[0, 1\]\) failed or timed "
        r"out after [0-9:]+: shared-memory collective #2 on axis 'dp': group rank 1 \(global rank 1, pid \d+\) "
        r"ended: its (process is gone|process exited \(a zombie\))",
        lines[0],
    ), lines[0]


def test_peers_are_checked_only_where_this_process_sees_them_as_recorded() -> None:
    me, start = os.getpid(), proc_stat(os.getpid())[1]
    namespace = os.stat("/proc/self/ns/pid").st_ino
    parent, parent_start = os.getppid(), proc_stat(os.getppid())[1]
    ids = torch.tensor([[me, parent], [start, parent_start], [namespace, namespace]])
    assert host_slots._watched_peers(ids, 0) == {1: (parent, parent_start)}
    assert host_slots._watched_peers(ids.clone().index_fill_(1, torch.tensor([1]), 0), 0) == {}  # unknown
    other = ids.clone()
    other[2, 1] += 1  # another PID namespace: its pid means nothing here
    assert host_slots._watched_peers(other, 0) == {}
    other = ids.clone()
    other[1, 1] += 1  # not the process that signed
    assert host_slots._watched_peers(other, 0) == {}
    assert host_slots._ended(parent, parent_start + 1) == "ended: its pid names another process now"


def _zero_over_plain_ddp(host_slots: bool) -> dict[str, torch.Tensor]:
    """ZeroOptimizer over a plain DDP whose buckets are slots (chunks cut at cache lines, not at the
    optimizer's ranges): the gather must not go through those slots."""
    from ndtrain.parallel.data.ddp import DistributedDataParallel
    from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer

    ctx = init(ParallelConfig(), init_method=init_method())
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)), ctx,
                                    host_slots=host_slots)
    zero = ZeroOptimizer(model, ctx, lambda groups: torch.optim.SGD(groups, lr=0.1))
    for step in range(3):
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(step))
        model(x.chunk(3)[ctx.rank]).square().mean().backward()
        zero.step()
        zero.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_zero_optimizer_over_plain_ddp_in_slots_matches_gloo() -> None:
    through_slots = run_distributed(_zero_over_plain_ddp, 3, True)
    through_gloo = run_distributed(_zero_over_plain_ddp, 3, False)
    for got, want in zip(through_slots, through_gloo):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a[name], through_slots[0][name]) for a in through_slots for name in a)
