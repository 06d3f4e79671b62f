"""DistributedDataParallel: parity with single-process training, bucketing, no_sync, exact bytes, unused parameters.

Each multi-process run executes every scenario in one spawn (imports dominate the cost) and
returns parameters; each scenario's checks are then their own tests. The parent trains the
single-process reference on the whole global batch.
The tiny Llama trains in float64 (parameters, all-reduce, AdamW): in fp32 the summation order of
the batch (one process vs shards and an all-reduce, and the CPU's kernels) moved it by up to
5e-6 after AdamW, half the 1e-5 bound (see test_zero.py); in fp64 by ~1e-15.
"""

from __future__ import annotations

import functools
import gc
import weakref
from contextlib import nullcontext
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.parallel.data.buckets import pack
from ndtrain.parallel.data.ddp import DistributedDataParallel
from tests.helpers.models import make_llama
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import train_reference
from tests.helpers.runner import Spawns, init_method

STEPS = 5
GLOBAL_BATCH = 16
LR = 1e-2
SEED = 100
TOL = 1e-5
LLAMA_DTYPE = torch.float64
TINY_BUCKET_MB = 4500 / 2**20  # fc3 + fc2.bias | fc2.weight | fc1: three buckets
# bf16 comm: unit roundoff 2^-8 ≈ 3.9e-3 per rounding, a few roundings per sum (seen: 6.3e-3 on 4 ranks).
BF16_GRAD_TOLERANCE = 2e-2
# AdamW divides each element by its own RMS, so where the ranks' contributions cancel the bf16 error
# turns into a different direction of up to lr per step (seen: 9.3e-2 after 5 steps on 4 ranks).
BF16_PARAM_TOLERANCE = 0.2

State = dict[str, torch.Tensor]


class Net(nn.Module):
    """Three Linear layers and a buffer; `spare` is used only when asked, `never` never."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.register_buffer("shift", torch.randn(8))
        if extra:
            self.spare = nn.Linear(32, 32)
            self.never = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x + self.shift))))
        if use_spare:
            h = h + self.spare(h)
        return F.mse_loss(self.fc3(h), y)


def make_net(seed: int, extra: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(extra)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def spare_used_on(rank: int) -> bool:
    return rank == 1


def state(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def reference(world: int, extra: bool = False) -> State:
    """Single process, whole batch: the loss is the mean of the per-rank losses (equal shards)."""
    model = make_net(SEED, extra)

    def loss_fn(net: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return net(x, y, extra and spare_used_on(rank))

    batches = (global_batch(step) for step in range(STEPS))
    return train_reference(model, torch.optim.AdamW(model.parameters(), lr=LR), batches, pieces=world, loss_fn=loss_fn).state


def reference_gradients() -> State:
    model = make_net(SEED)
    model(*global_batch(0)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ workers
def _wrap(ctx: ParallelContext, extra: bool = False, **ddp_kwargs: Any) -> DistributedDataParallel:
    """A DistributedDataParallel Net built from a rank-dependent seed: the broadcast must make the ranks equal."""
    return DistributedDataParallel(make_net(SEED + ctx.rank, extra), ctx, **ddp_kwargs)


def _train(ctx: ParallelContext, model: DistributedDataParallel, *, micro_steps: int = 1, zero: str = "optimizer",
           on_backward: Callable[[bool], None] = lambda synced: None) -> State:
    """5 AdamW steps on this rank's shard of each global batch, in `micro_steps` micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n, rank = ctx.world_size, ctx.rank
    use_spare = hasattr(model.module, "spare") and spare_used_on(rank)
    for step in range(STEPS):
        x, y = global_batch(step)
        xs, ys = x.chunk(n)[rank].chunk(micro_steps), y.chunk(n)[rank].chunk(micro_steps)
        for micro in range(micro_steps):
            synced = micro == micro_steps - 1
            with nullcontext() if synced else model.no_sync():
                (model(xs[micro], ys[micro], use_spare) / micro_steps).backward()
            on_backward(synced)
        opt.step()
        if zero == "wrapper":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
    return state(model.module)


def _accounting_run(ctx: ParallelContext, host_slots: bool = False) -> dict[str, Any]:
    """Accumulation over 2 micro-steps with tiny buckets, recording the comm counters per backward."""
    model = _wrap(ctx, bucket_mb=TINY_BUCKET_MB, host_slots=host_slots)
    deltas: list[tuple[bool, int, int]] = []
    last = [ctx.comm.stats.total_calls(), ctx.comm.stats.total_wire_bytes()]

    def record(synced: bool) -> None:
        calls, wire = ctx.comm.stats.total_calls(), ctx.comm.stats.total_wire_bytes()
        deltas.append((synced, calls - last[0], wire - last[1]))
        last[:] = [calls, wire]

    params = _train(ctx, model, micro_steps=2, on_backward=record)
    kinds = sorted({type(b).__name__ for b in model.buckets})
    return {"params": params, "deltas": deltas, "buckets": model.bucket_count, "grad_bytes": model.gradient_bytes,
            "kinds": kinds, "ops": sorted(ctx.comm.stats.snapshot())}


def _first_gradients(ctx: ParallelContext, model: DistributedDataParallel) -> State:
    """The gradient after one synchronising backward on this rank's shard of the first batch."""
    x, y = global_batch(0)
    model(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]).backward()
    return {name: p.grad.clone() for name, p in model.module.named_parameters()}


def _suite(with_llama: bool) -> dict[str, Any]:
    """All scenarios, serialised: tensors sent through the result queue would share memory by file
    descriptor, which breaks once the worker has exited."""
    ctx = init(ParallelConfig(), init_method=init_method())
    out: dict[str, Any] = {"init": state(_wrap(ctx).module)}
    model = _wrap(ctx)
    out["plain"] = _train(ctx, model)  # optimizer.zero_grad(set_to_none=True) between steps
    x, y = global_batch(STEPS)
    model(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]).backward()  # grads were set to None
    out["plain_grads_in_buckets"] = len({id(p.grad._base) for p in model.parameters()}) == model.bucket_count
    model = _wrap(ctx, bucket_mb=TINY_BUCKET_MB)
    out["buckets"], out["bucket_count"] = _train(ctx, model, zero="wrapper"), model.bucket_count
    out["accumulate"] = _accounting_run(ctx)
    out["host_accumulate"] = _accounting_run(ctx, host_slots=True)  # through shared-memory slots
    out["grads"] = _first_gradients(ctx, _wrap(ctx))
    out["bf16_grads"] = _first_gradients(ctx, _wrap(ctx, comm_dtype=torch.bfloat16))
    model = _wrap(ctx, comm_dtype=torch.bfloat16)
    out["bf16"], out["bf16_grad_bytes"] = _train(ctx, model), model.gradient_bytes
    try:
        _train(ctx, _wrap(ctx, extra=True))
        out["unused_error"] = None
    except UserError as e:
        out["unused_error"] = str(e)
    model = _wrap(ctx, extra=True, allow_unused=True)
    out["allow_unused"] = _train(ctx, model)
    out["never_grad_is_none"] = model.module.never.weight.grad is None
    if with_llama:
        out["llama"] = _train_llama(ctx)
    return out


def _llama_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3, 4, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train_llama(ctx: ParallelContext, world: int = 2) -> State:
    model = DistributedDataParallel(make_llama(LLAMA_DTYPE), ctx, bucket_mb=0.02, comm_dtype=LLAMA_DTYPE)  # the buckets of 0.01 MB of fp32
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens, targets in _llama_batches():
        tokens, targets = tokens.chunk(world)[ctx.rank], targets.chunk(world)[ctx.rank]
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return state(model.module)


# ------------------------------------------------------------------------------------ tests
def test_pack_keeps_order_caps_size_and_separates_dtypes() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64), torch.zeros(10)]
    # cap 100 bytes: 40 + 40 fit; the 120-byte tensor is alone; float64 never shares with float32.
    assert pack(ts, 100) == [[0, 1], [2], [3], [4]]
    assert pack(ts, 10**6) == [[0, 1, 2, 4], [3]]


def test_single_rank_buckets_views_and_zero_grad() -> None:
    ctx = init(ParallelConfig())
    model = DistributedDataParallel(make_net(SEED), ctx, bucket_mb=TINY_BUCKET_MB)
    assert model.bucket_count == 3
    assert model.gradient_bytes == sum(p.numel() * 4 for p in model.parameters())
    ref = make_net(SEED)
    x, y = global_batch(0)
    for zero in ("wrapper", "optimizer"):
        model(x, y).backward()
        ref(x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            assert p.grad._base is not None  # a view of its bucket
        if zero == "wrapper":
            model.zero_grad()
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        else:
            model.module.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    """One spawn per world size (at its first test) runs every scenario; the tiny Llama on 2 ranks only."""
    return Spawns(_suite)


def _out(spawns: Spawns, world: int) -> list[dict[str, Any]]:
    return spawns.get(world, world, world == 2)


@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_makes_the_ranks_equal(spawns: Spawns, world: int) -> None:
    init_ref = state(make_net(SEED))
    for rank, o in enumerate(_out(spawns, world)):
        assert_params_close(o["init"], init_ref, 0.0, f"rank {rank} broadcast")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["plain", "buckets", "accumulate", "host_accumulate", "allow_unused"])
def test_training_matches_single_process(spawns: Spawns, world: int, scenario: str) -> None:
    ref = reference(world, extra=scenario == "allow_unused")
    for rank, o in enumerate(_out(spawns, world)):
        got = o[scenario]["params"] if scenario.endswith("accumulate") else o[scenario]
        assert_params_close(got, ref, TOL, f"{scenario} rank {rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_are_bucket_views_and_an_unused_one_stays_none(spawns: Spawns, world: int) -> None:
    for o in _out(spawns, world):
        assert o["plain_grads_in_buckets"] and o["bucket_count"] >= 3 and o["never_grad_is_none"]


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_match_single_process_and_bf16_stays_close(spawns: Spawns, world: int) -> None:
    ref, grads = reference(world), reference_gradients()
    for rank, o in enumerate(_out(spawns, world)):
        assert_params_close(o["grads"], grads, TOL, f"gradients rank {rank}")
        assert assert_params_close(o["bf16_grads"], grads, BF16_GRAD_TOLERANCE, f"bf16 gradients rank {rank}") > 0.0
        assert assert_params_close(o["bf16"], ref, BF16_PARAM_TOLERANCE, f"bf16 rank {rank}") > 0.0


@pytest.mark.parametrize("world", [2, 4])
def test_unused_parameters_are_named(spawns: Spawns, world: int) -> None:
    for rank, o in enumerate(_out(spawns, world)):
        unused = ("" if spare_used_on(rank) else "spare.weight, spare.bias, ") + "never.weight, never.bias"
        assert o["unused_error"] == (
            f"parameters received no gradient: {unused}; set parallel.allow_unused_params=true if that is intended"
        )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("run", ["accumulate", "host_accumulate"])
def test_accumulation_sends_once_per_step_with_exact_bytes(spawns: Spawns, world: int, run: str) -> None:
    """Through gloo or through the shared-memory slots (one host): the same calls and ring volume."""
    out = _out(spawns, world)
    acc = out[0][run]
    kind, op = ("HostAllReduceBucket", "all_reduce_shm/dp_cp") if run == "host_accumulate" else ("AllReduceBucket", "all_reduce/dp_cp")
    assert acc["kinds"] == [kind] and op in acc["ops"]
    grad_bytes = sum(v.numel() * 4 for k, v in reference(world).items() if k != "shift")
    assert acc["grad_bytes"] == grad_bytes and out[0]["bf16_grad_bytes"] == grad_bytes // 2
    assert acc["buckets"] >= 3
    ring = 2 * (world - 1) * grad_bytes // world
    # per step: one backward inside no_sync (nothing sent), then one synchronising backward.
    assert acc["deltas"] == [(False, 0, 0), (True, acc["buckets"], ring)] * STEPS


def test_llama_matches_single_process_on_two_ranks(spawns: Spawns) -> None:
    llama = make_llama(LLAMA_DTYPE)
    llama_ref = train_reference(llama, torch.optim.AdamW(llama.parameters(), lr=LR), _llama_batches()).state
    for rank, o in enumerate(_out(spawns, 2)):
        assert all(v.dtype == LLAMA_DTYPE for v in o["llama"].values())
        assert_params_close(o["llama"], llama_ref, TOL, f"llama rank {rank}")


def test_dropped_wrapper_is_collected_and_unhooks_its_module() -> None:
    ctx = init(ParallelConfig())
    net = make_net(SEED)
    wrapper = weakref.ref(DistributedDataParallel(net, ctx))
    gc.collect()
    assert wrapper() is None  # hooks hold it weakly: no cycle through autograd's C++ side
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    again = DistributedDataParallel(net, ctx)
    again(*global_batch(0)).backward()
    assert all(p.grad._base is not None for p in net.parameters())
