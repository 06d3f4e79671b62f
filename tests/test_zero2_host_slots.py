"""ZeRO-2 reduce-scattering through a pool of shared-memory segments (zero2_gradients.py `SlotPool`).

One spawn per world size (2 and 4 ranks) trains the tiny Llama in float64 through the Engine, with
clipping and 2 micro-batches per step (each micro-batch's backward reduce-scatters every bucket),
buckets of 0.01 MB: more buckets than the pool's MAX_IN_FLIGHT + 1 segments, so every segment is
taken in turn by several buckets of different sizes in each backward.
- through the slots (the default on one host): parameters and norms equal the single-process run
  (relative error ≤ 1e-5) and the gloo run's; every micro-batch reduce-scatters every bucket once
  through the slots, exactly (N−1)/N·8Ψ' counted per micro-batch, and nothing through gloo;
- through gloo (`host_shared_memory=false`): the same volume as `reduce_scatter`, no slots;
- at 2 ranks, one backward inside `weight_pass()` (zb's W) stages every bucket before launching
  any: the first bucket of each segment in its slot, the others privately, copied into their slot
  at launch; the shards equal those of the same backward run as usual, bit for bit; a backward
  that reaches one parameter only leaves exact zeros for all the others (the slots are zeroed);
- at 2 ranks, a rank that cannot map the segments (its own /dev/shm directory, as on another host)
  makes every rank keep gloo's buckets, and the training still matches.
Every run makes its segments in a directory of its own under /dev/shm, empty after construction
and after the run (the segments are unlinked once mapped).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.dist.host_slots import HostSlots, host_slots_supported
from ndtrain.dist.mesh import init
from ndtrain.parallel.data.buckets import MB, pack
from ndtrain.parallel.data.zero2_gradients import MAX_IN_FLIGHT, Zero2DataParallel
from tests.helpers.counts import train_counted
from tests.helpers.models import adamw, batch, make_llama, micro_batches
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import Reference, decay_groups, train_reference
from tests.helpers.runner import Spawns, case_result, init_method, run_each

pytestmark = [pytest.mark.skipif(not host_slots_supported(), reason="shared-memory slots need x86-64 Linux"),
              pytest.mark.usefixtures("one_thread")]
STEPS = 3
ACCUMULATION = 2
MAX_NORM = 0.3  # below the tiny model's gradient norms: clipping is exercised
BUCKET_MB = 0.01
DTYPE = torch.float64
CASES = {"slots": True, "gloo": False, "fallback": True}  # case → parallel.host_shared_memory
WORLDS = {2: list(CASES), 4: ["slots", "gloo"]}


@functools.cache
def reference(world: int) -> Reference:
    """Single process, whole global batch, its loss the mean over the world's micro-batches."""
    model = make_llama(DTYPE)
    batches = (batch(step) for step in range(STEPS))
    return train_reference(model, adamw(decay_groups(model)), batches, pieces=world * ACCUMULATION, clip=MAX_NORM)


def padded_buckets(world: int) -> list[int]:
    """From first principles: the buckets (trainable parameters in reverse order, bucket cap), each
    padded to a multiple of N."""
    params = [p for p in make_llama(DTYPE).parameters()][::-1]
    return [-(-sum(params[i].numel() for i in run) // world) * world for run in pack(params, int(BUCKET_MB * MB))]


# ------------------------------------------------------------------------------------ worker
def _train(name: str, directory: Path) -> dict[str, Any]:
    parallel = ParallelConfig(zero=2, bucket_mb=BUCKET_MB, host_shared_memory=CASES[name])
    ctx = init(parallel, init_method=init_method())
    opens = HostSlots.__dict__["open"]
    HostSlots.open = staticmethod(functools.partial(HostSlots.open, directory=directory))  # type: ignore[method-assign]
    try:  # the segments are made in `directory`, the tests' stand-in for a host's /dev/shm
        engine = Engine(lambda: make_llama(DTYPE), adamw, ctx, parallel, grad_clip=MAX_NORM)
    finally:
        HostSlots.open = opens  # type: ignore[method-assign]
    left = os.listdir(directory)
    norms, deltas = train_counted(engine, ctx, STEPS, ACCUMULATION)
    return {"params": engine.full_state_dict(), "norms": norms, "deltas": deltas, "left": left + os.listdir(directory),
            "kinds": {type(b).__name__ for w in engine.dp.chunks for b in w.buckets}}


def _weight_pass() -> dict[str, Any]:
    """One backward inside `weight_pass()` (zb's W: every bucket staged before any launch, most of
    them privately) and the same backward as usual: the same shards, bit for bit."""
    ctx = init(ParallelConfig(), init_method=init_method())
    model = Zero2DataParallel(make_llama(DTYPE), ctx, bucket_mb=BUCKET_MB, host_slots=True)
    x, y = micro_batches(0, ctx.rank, ctx.world_size, 1)[0]
    with model.weight_pass():
        model(x, y).backward()
        staged = [(b.staging is not None, b.staging is not None and b.staging.data_ptr() == b.segment.mine.data_ptr())
                  for b in model.buckets]
    shards = [b.shard.clone() for b in model.buckets]
    model.zero_grad()
    model(x, y).backward()
    same = all(torch.equal(a, b.shard) for a, b in zip(shards, model.buckets))
    model.zero_grad()
    first = next(model.module.parameters())  # in the last bucket, on a segment used before: the others' slots zeroed?
    first.sum().backward()  # a gradient of ones for it, none for every other parameter (zero)
    return {"staged": staged, "same": same, "kinds": {type(b).__name__ for b in model.buckets},
            "ones": sum(b.shard.sum().item() for b in model.buckets), "numel": first.numel()}


def _suite(directories: list[str]) -> dict[str, dict[str, Any]]:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # fallback: each rank looks for rank 0's segments in a directory of its own, as on another host
    out = run_each(lambda name: _train(name, Path(directories[rank if name == "fallback" else 0])), WORLDS[world])
    return {**out, **run_each(lambda _: _weight_pass(), ["weight-pass"] if world == 2 else [])}


@pytest.fixture(scope="module")
def directories() -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as a, tempfile.TemporaryDirectory(dir="/dev/shm") as b:
        yield [a, b, b, b]


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_suite, timeout=300)


# ------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("world", WORLDS)
def test_zero2_through_slots_matches_one_process_and_gloo(world: int, spawns: Spawns, directories: list[str]) -> None:
    ref = reference(world)
    assert max(ref.norms) > MAX_NORM
    padded, e = padded_buckets(world), DTYPE.itemsize  # the fp32 comm dtype reduces float64 in float64
    assert len(padded) > 2 * (MAX_IN_FLIGHT + 1)  # every segment of the pool is taken by several buckets
    per_micro_batch = {"calls": len(padded), "payload_bytes": e * sum(padded),
                       "wire_bytes": sum((world - 1) * e * p // world for p in padded)}
    expected = {k: v * ACCUMULATION for k, v in per_micro_batch.items()}
    results = spawns.get(world, world, directories)
    slots, gloo = case_result(results, "slots"), case_result(results, "gloo")
    for rank, (run, other) in enumerate(zip(slots, gloo)):
        assert run["kinds"] == {"HostReduceScatterBucket"} and other["kinds"] == {"ReduceScatterBucket"}
        assert {t.dtype for t in run["params"].values()} == {DTYPE}
        assert_params_close(run["params"], ref.state, 1e-5, f"world {world} slots rank {rank}")
        assert_params_close(run["params"], other["params"], 1e-5, f"world {world} slots vs gloo rank {rank}")
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref.norms), rtol=1e-5, atol=0)
        for delta, gloo_delta in zip(run["deltas"], other["deltas"]):
            assert delta["reduce_scatter_shm/dp_cp"] == expected, delta
            assert "reduce_scatter/dp_cp" not in delta and "reduce_scatter_shm/dp_cp" not in gloo_delta
            assert gloo_delta["reduce_scatter/dp_cp"] == expected
            assert delta["all_reduce/dp_cp"]["calls"] == 3  # the target count, the norm and the loss, no gradient
        assert run["left"] == [] and other["left"] == []
    assert all(os.listdir(d) == [] for d in directories)  # nothing left behind after the processes ended


def test_a_rank_that_cannot_map_the_pool_keeps_every_rank_on_gloo(spawns: Spawns, directories: list[str]) -> None:
    ref = reference(2)
    for rank, run in enumerate(case_result(spawns.get(2, 2, directories), "fallback")):
        assert run["kinds"] == {"ReduceScatterBucket"}
        assert all("reduce_scatter/dp_cp" in d and "reduce_scatter_shm/dp_cp" not in d for d in run["deltas"])
        assert_params_close(run["params"], ref.state, 1e-5, f"fallback rank {rank}")
        assert run["left"] == []


def test_buckets_staged_before_their_turn_go_through_the_slots_alike(spawns: Spawns, directories: list[str]) -> None:
    runs = case_result(spawns.get(2, 2, directories), "weight-pass")
    for run in runs:
        assert run["kinds"] == {"HostReduceScatterBucket"}
        assert all(staged for staged, _ in run["staged"])
        in_slots = [in_slot for _, in_slot in run["staged"]]
        assert in_slots == [k < MAX_IN_FLIGHT + 1 for k in range(len(in_slots))]  # the first bucket of each segment
        assert run["same"]
    assert sum(run["ones"] for run in runs) == runs[0]["numel"]  # mean 1 on its elements, exactly 0 elsewhere
