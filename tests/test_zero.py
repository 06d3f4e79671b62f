"""ZeRO-1: parity with single-process AdamW (weight-decay groups, clipping, LR schedule), exact state
and comm bytes, empty shards, state-dict round trip, bad optimizer factories.

One spawn per world size runs every scenario, each then its own test case; the parent trains the
single-process references and computes the expected shard layout on its own (from `pack`, the bucketing rule of ddp.py).

The parity runs and their references train in float64 (parameters, gradients, all-reduce, AdamW
state). In float32 the comparison measured the CPU, not ZeRO: the ranks sum the shard gradients in
gloo's ring order, the reference in autograd's, and AdamW gives an element whose gradient nearly
cancels an update of about lr whatever the gradient's size, so the sum's last-bit rounding becomes a
parameter error. Summing the reference's own 4 shard gradients in another order already moved the
tiny Llama by 8.5e-6 relative (its fp32 run is 1.4e-5 away from its fp64 run), and an AVX-512 CPU's
kernels reached 2.5e-5. In float64 the same effect is ~1e-15, so the 1e-5 bound has a margin of many
orders of magnitude, and a wrong shard, group or gather still moves parameters by far more.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.parallel.data.buckets import MB, pack
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.zero1_gradients import Zero1DataParallel
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from tests.helpers.counts import counted_since
from tests.helpers.models import make_llama
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import train_reference
from tests.helpers.runner import Spawns, case_result, init_method, run_each

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # small enough that the Net's gradient is clipped
SEED = 100
DTYPE = torch.float64  # of the parity runs (see the docstring)
TOL = 1e-5
NET_BUCKET_MB = 65 * DTYPE.itemsize / MB  # buckets of 60 | 11 | 143 | 13 | 91 | 1 elements: mixed groups in the first, then odd
PER_PARAM_BUCKET_MB = 1 / MB  # one bucket per parameter: the 1-element `scale` leaves ranks empty
LLAMA_BUCKET_MB = 0.01 * DTYPE.itemsize / 4  # the buckets of 0.01 MB of fp32

State = dict[str, torch.Tensor]


class Net(nn.Module):
    """Linear layers of odd sizes and a scalar gain."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.tanh(layer(x))
        return F.mse_loss(self.scale * x, y)


NET = (7, 13, 11, 5)
LONELY = (1, 1)  # 3 elements: on 4 ranks, rank 3 owns nothing at all


# scenario → (_check_run's kind, bucket MB, sizes, clipped)
SCENARIOS: dict[str, tuple[str, float, tuple[int, ...], bool]] = {
    "net": ("net", NET_BUCKET_MB, NET, True),
    "per_param": ("net", PER_PARAM_BUCKET_MB, NET, True),
    "lonely": ("net", NET_BUCKET_MB, LONELY, False),
    "llama": ("llama", LLAMA_BUCKET_MB, NET, False),
}


def make_net(sizes: tuple[int, ...], seed: int, dtype: torch.dtype = DTYPE) -> Net:
    torch.manual_seed(seed)
    return Net(sizes).to(dtype)


def net_batch(sizes: tuple[int, ...], step: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, sizes[0], generator=g), torch.randn(GLOBAL_BATCH, sizes[-1], generator=g)
    return x.to(dtype), y.to(dtype)


def llama_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)


def state(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    first_is_decay = next(iter(model.parameters())).ndim >= 2
    groups = [{"params": decay}, {"params": other, "weight_decay": 0.0}]
    return groups if first_is_decay else groups[::-1]


@functools.cache
def reference(kind: str, world: int, sizes: tuple[int, ...] = NET, dtype: torch.dtype = DTYPE) -> tuple[State, list[float]]:
    """Single process, whole global batch; its loss is the mean of the per-rank shard losses (equal shards)."""
    model = make_llama(DTYPE) if kind == "llama" else make_net(sizes, SEED, dtype)
    opt = adamw(reference_groups(model))
    batches = (llama_batch(step) if kind == "llama" else net_batch(sizes, step, dtype) for step in range(STEPS))
    ref = train_reference(model, opt, batches, pieces=world, clip=MAX_NORM, scheduler=LambdaLR(opt, schedule))
    return ref.state, ref.norms


def expected_layout(model: nn.Module, bucket_mb: float, world: int) -> dict[str, Any]:
    """Ψ, Ψ', buckets and, per rank, real elements and segments (runs of one group), from first principles."""
    named = [(n, p) for n, p in model.named_parameters()][::-1]
    params = [p for _, p in named]
    first_group = 0 if next(iter(model.parameters())).ndim >= 2 else 1  # index of the decay group
    runs = pack(params, max(1, int(bucket_mb * MB)))
    sizes, padded, elems, segments = [], 0, [0] * world, [0] * world
    for run in runs:
        labels = torch.cat([torch.full((params[i].numel(),), first_group if params[i].ndim >= 2 else 1 - first_group)
                            for i in run])
        numel = labels.numel()
        size = -(-numel // world)
        sizes.append(numel)
        padded += size * world
        for r in range(world):
            mine = labels[r * size : min((r + 1) * size, numel)]
            elems[r] += mine.numel()
            segments[r] += int((mine[1:] != mine[:-1]).sum()) + 1 if mine.numel() else 0
    return {"numel": sum(sizes), "padded": padded, "buckets": len(sizes), "sizes": sizes, "elems": elems,
            "segments": segments}


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, kind: str, bucket_mb: float, sizes: tuple[int, ...] = NET,
           steps: int = STEPS, resume_at: int | None = None) -> dict[str, Any]:
    rank, n = ctx.rank, ctx.world_size
    module = make_llama(DTYPE) if kind == "llama" else make_net(sizes, SEED + rank)  # broadcast makes them equal
    model = Zero1DataParallel(module, ctx, bucket_mb=bucket_mb, comm_dtype=DTYPE)
    zero = ZeroOptimizer(model, ctx, adamw, group_fn=no_decay_for_vectors)
    sched = LambdaLR(zero, schedule)
    out: dict[str, Any] = {"deltas": [], "norms": [], "saved": None}
    for step in range(steps):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save({"model": model.module.state_dict(), "zero": zero.state_dict(), "sched": sched.state_dict()}, buffer)
            out["saved"] = buffer.getvalue()
        x, y = llama_batch(step) if kind == "llama" else net_batch(sizes, step)
        before = ctx.comm.stats.snapshot()
        model(x.chunk(n)[rank], y.chunk(n)[rank]).backward()
        out["norms"].append(zero.clip_grad_norm_(MAX_NORM).item())
        zero.step()
        after = ctx.comm.stats.snapshot()
        out["deltas"].append(counted_since(before, after))
        sched.step()
        zero.zero_grad()
    out["params"] = state(model.module)
    out["state_bytes"] = zero.state_bytes()
    out["shard_numel"], out["padded_numel"] = zero.shard_numel, zero.padded_numel
    out["views"] = all(p.untyped_storage().data_ptr() in {s.flat.untyped_storage().data_ptr() for s in zero._shards}
                       for p in model.module.parameters())
    return out


def _resume(ctx: ParallelContext, saved: bytes, first: int) -> dict[str, Any]:
    """Rebuild from a checkpoint taken before step `first` and train to STEPS; also a wrong-layout load."""
    rank, n = ctx.rank, ctx.world_size
    model = Zero1DataParallel(make_net(NET, SEED + 1000 + rank), ctx, bucket_mb=NET_BUCKET_MB, comm_dtype=DTYPE)
    zero = ZeroOptimizer(model, ctx, adamw, group_fn=no_decay_for_vectors)
    sched = LambdaLR(zero, schedule)
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    sched.load_state_dict(ckpt["sched"])
    zero.load_state_dict(ckpt["zero"])
    for step in range(first, STEPS):
        x, y = net_batch(NET, step)
        model(x.chunk(n)[rank], y.chunk(n)[rank]).backward()
        zero.clip_grad_norm_(MAX_NORM)
        zero.step()
        sched.step()
        zero.zero_grad()
    wrong = {**ckpt["zero"], "layout": {**ckpt["zero"]["layout"], "rank": (rank + 1) % n}}
    try:
        zero.load_state_dict(wrong)
        error = None
    except UserError as e:
        error = str(e)
    return {"params": state(model.module), "wrong_layout_error": error}


def _scenario(ctx: ParallelContext, name: str) -> dict[str, Any]:
    kind, bucket_mb, sizes, _ = SCENARIOS[name]
    return _train(ctx, kind, bucket_mb, sizes=sizes, resume_at=3 if name == "net" else None)


def _suite() -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    out = run_each(lambda name: _scenario(ctx, name), SCENARIOS)
    out |= run_each(lambda _: _resume(ctx, out["net"].pop("saved"), 3), ["resumed"])
    return out


# ------------------------------------------------------------------------------------ checks
def _check_run(runs: list[dict[str, Any]], world: int, kind: str, bucket_mb: float, sizes: tuple[int, ...] = NET,
               clipped: bool = True) -> None:
    ref, ref_norms = reference(kind, world, sizes)
    model = make_llama(DTYPE) if kind == "llama" else make_net(sizes, SEED)
    layout = expected_layout(model, bucket_mb, world)
    if kind == "net" and clipped:
        assert max(ref_norms) > MAX_NORM  # the clipping path is exercised
    item = DTYPE.itemsize
    ring = (world - 1) * item * layout["padded"] // world  # one reduce-scatter of every bucket
    expected_delta = {
        "reduce_scatter/dp_cp": {"calls": layout["buckets"], "payload_bytes": item * layout["padded"], "wire_bytes": ring},
        "all_reduce/dp_cp": {"calls": 1, "payload_bytes": item, "wire_bytes": 2 * (world - 1) * item // world},  # the norm
        # gloo: every bucket gathered by N broadcasts of a rank's slice, each counted once, at its root
        "broadcast/dp_cp": {"calls": layout["buckets"] * world, "payload_bytes": item * layout["padded"],
                            "wire_bytes": item * layout["padded"] // world},
    }
    for rank, o in enumerate(runs):
        assert all(p.dtype == DTYPE for p in o["params"].values())
        assert_params_close(o["params"], ref, TOL, f"{kind} {sizes} bucket {bucket_mb} MB rank {rank}")
        torch.testing.assert_close(torch.tensor(o["norms"]), torch.tensor(ref_norms), rtol=TOL, atol=0)
        assert o["deltas"] == [expected_delta] * STEPS, (kind, rank)
        assert o["shard_numel"] == layout["elems"][rank]
        assert o["padded_numel"] == layout["padded"]
        # AdamW: exp_avg + exp_avg_sq (in DTYPE) per real element of the shard, one fp32 step counter per segment.
        assert o["state_bytes"] == 2 * item * layout["elems"][rank] + 4 * layout["segments"][rank], (kind, rank)
        assert o["views"]
    assert sum(layout["elems"]) == layout["numel"]
    assert max(layout["elems"]) <= layout["padded"] // world


def test_layouts_from_first_principles() -> None:
    for world in (2, 4):
        layout = expected_layout(make_net(NET, SEED), NET_BUCKET_MB, world)
        assert layout["sizes"] == [60, 11, 143, 13, 91, 1]  # 5 sizes not divisible by N, one shorter than N
        assert layout["segments"][0] == 7  # rank 0: bias | weight in bucket 0 (two groups), one in each other bucket
        assert min(expected_layout(make_net(LONELY, SEED), NET_BUCKET_MB, world)["elems"]) == (0 if world == 4 else 1)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    """One spawn per world size (at its first case) runs every scenario."""
    return Spawns(_suite)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ranks_match_single_process(spawns: Spawns, world: int, scenario: str) -> None:
    kind, bucket_mb, sizes, clipped = SCENARIOS[scenario]
    _check_run(case_result(spawns.get(world, world), scenario), world, kind, bucket_mb, sizes, clipped)


@pytest.mark.parametrize("world", [2, 4])
def test_resumed_training_is_identical_and_a_wrong_layout_is_refused(spawns: Spawns, world: int) -> None:
    out = spawns.get(world, world)
    for rank, (net, resumed) in enumerate(zip(case_result(out, "net"), case_result(out, "resumed"))):
        for k, v in net["params"].items():
            assert torch.equal(resumed["params"][k], v), (rank, k)  # identical continued training
        assert "different rank/world" in resumed["wrong_layout_error"]


def test_single_rank_equals_plain_adamw_and_keeps_lr_schedule() -> None:
    ctx = init(ParallelConfig())
    model = DistributedDataParallel(make_net(NET, SEED, torch.float32), ctx, bucket_mb=NET_BUCKET_MB)
    zero = ZeroOptimizer(model, ctx, adamw, group_fn=no_decay_for_vectors)
    sched = LambdaLR(zero, schedule)
    assert [g["lr"] for g in zero.param_groups] == pytest.approx([LR / 3] * 2)
    for step in range(STEPS):
        model(*net_batch(NET, step, torch.float32)).backward()
        zero.clip_grad_norm_(MAX_NORM)
        zero.step()
        sched.step()
        zero.zero_grad()
    ref, _ = reference("net", 1, dtype=torch.float32)
    assert_params_close(state(model.module), ref, 1e-6, "one rank")
    assert [g["lr"] for g in zero.param_groups] == pytest.approx([LR] * 2)
    assert zero.state_bytes() == 8 * sum(p.numel() for p in model.parameters()) + 4 * len(zero.state)


def test_fp64_parameters_are_their_own_master() -> None:
    """fp64 parameters are updated in fp64: no fp32 master copy, no fp32 gradient norm."""
    ctx = init(ParallelConfig())
    model = DistributedDataParallel(make_net(NET, SEED, torch.float64), ctx, comm_dtype=torch.float64)
    zero = ZeroOptimizer(model, ctx, adamw, group_fn=no_decay_for_vectors)
    sched = LambdaLR(zero, schedule)
    for step in range(STEPS):
        model(*net_batch(NET, step, torch.float64)).backward()
        zero.clip_grad_norm_(MAX_NORM)
        zero.step()
        sched.step()
        zero.zero_grad()
    assert zero.master_bytes == 0
    assert {t.dtype for s in zero.state.values() for k, t in s.items() if k != "step"} == {torch.float64}
    ref, _ = reference("net", 1, dtype=torch.float64)
    assert_params_close(state(model.module), ref, 1e-12, "one rank, fp64")  # fp32 master and norm: 2.3e-9


def test_factory_that_ignores_its_groups_is_a_clear_error() -> None:
    ctx = init(ParallelConfig())
    model = DistributedDataParallel(make_net(NET, SEED), ctx)
    with pytest.raises(UserError, match="exactly the parameter groups it is given"):
        ZeroOptimizer(model, ctx, lambda groups: torch.optim.AdamW(model.parameters(), lr=LR))
    with pytest.raises(UserError, match="exactly the parameter groups it is given"):  # groups merged
        ZeroOptimizer(model, ctx, lambda groups: torch.optim.AdamW([p for g in groups for p in g["params"]], lr=LR),
                      group_fn=no_decay_for_vectors)
    with pytest.raises(UserError, match="not a torch.optim.Optimizer"):
        ZeroOptimizer(model, ctx, lambda groups: groups)  # type: ignore[arg-type, return-value]
    with pytest.raises(UserError, match="DistributedDataParallel-wrapped"):
        ZeroOptimizer(model.module, ctx, adamw)  # type: ignore[arg-type]


def test_zero2_keeps_only_the_gradient_shard() -> None:
    """ZeRO-2 frees autograd's gradients at once and holds at most MAX_IN_FLIGHT + 1 staging buckets."""
    from ndtrain.parallel.data import zero2_gradients as zero2

    ctx = init(ParallelConfig())
    model = zero2.Zero2DataParallel(make_net(NET, SEED, torch.float32), ctx, bucket_mb=PER_PARAM_BUCKET_MB)  # 7 buckets
    zero = ZeroOptimizer(model, ctx, adamw)
    live: list[int] = []
    for p in model.module.parameters():
        p.register_post_accumulate_grad_hook(lambda _: live.append(sum(b.staging is not None for b in model.buckets)))
    model(*net_batch(NET, 0, torch.float32)).backward()
    assert len(model.buckets) == 7 and len(live) == 7
    assert max(live) <= zero2.MAX_IN_FLIGHT + 1 and max(live) >= 2  # counted after the wrapper's hook
    assert all(p.grad is None for p in model.module.parameters())
    assert all(b.staging is None and b.received is None for b in model.buckets)
    assert model.gradient_bytes == 4 * sum(p.numel() for p in model.module.parameters())  # N = 1: the shard is all
    zero.step()
