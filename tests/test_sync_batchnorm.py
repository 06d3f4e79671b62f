"""Synchronised BatchNorm and buffer broadcasts (issue 33, item 2).

In one process: `SyncBatchNorm` over a group of one rank is torch's BatchNorm (forward, the input's,
γ's and β's gradients, running statistics with momentum or the cumulative average, eval), and the
conversion keeps every tensor and name. On gloo ranks: the digits task's BatchNorm CNN
(models/digits_cnn.py) trained by `Engine` on 2 and 4 ranks, each rank holding an uneven part of a
global batch of 11 images (tensor_split: 6 | 5, and 3 | 3 | 3 | 2), equals one process holding the
whole batch with torch's BatchNorm, parameters and running statistics alike, under DDP and
ZeRO-1/2/3, and with two micro-batches per step; without `parallel.sync_batchnorm` the same run is
far from it and its ranks' statistics differ (the drift the option fixes). Everything trains in float64.

Each rank's loss is the mean over its samples; the engine weights it by the rank's share of the global
batch's samples (parallel/target_mean.py), so uneven shards train on the global batch's mean. The test model also counts the samples a
rank trained on in a buffer (`seen`): a non-BatchNorm buffer that drifts with uneven shards, which
`parallel.broadcast_buffers` keeps equal to rank 0's (exact counts, and the broadcasts' exact bytes).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ParallelConfig, load_config
from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.models.build import build_meta_model, build_seeded_model
from ndtrain.models.digits import DigitsNet
from ndtrain.models.digits_cnn import BatchNormDigitsNet, build_digits_net
from ndtrain.parallel.data.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, describe_batchnorm
from tests.helpers.counts import counted_since
from tests.helpers.parity import assert_params_close, max_relative_error
from tests.helpers.reference import decay_groups, train_reference
from tests.helpers.runner import Spawns, case_result, init_method, run_distributed, run_each
from tests.helpers.runs import train

DTYPE = torch.float64
BATCH = 11         # images per micro-batch group: uneven over 2 and 4 ranks
STEPS = 3
DIM = 16
SEED = 3
LR = 1e-2
TOL = 1e-7         # float64; AdamW amplifies the rounding of near-cancelling gradients: measured 4.5e-10 (4e-15 with SGD)
DRIFT = 1e-3       # what per-rank BatchNorm moves the same run by, at least
CHANNELS = (32, 64, 64, 128)  # the BatchNorm layers of the BN CNN
# name → (zero, sync_batchnorm, broadcast_buffers, micro-batches per step)
CASES: dict[str, tuple[int, bool, bool, int]] = {
    "ddp-sync": (0, True, False, 1),
    "ddp-local": (0, False, False, 1),
    "ddp-sync-acc2": (0, True, False, 2),
    "ddp-sync-buffers": (0, True, True, 1),
    "ddp-local-buffers": (0, False, True, 1),
    "zero1-sync": (1, True, False, 2),
    "zero2-sync-buffers": (2, True, True, 2),
    "zero3-sync": (3, True, False, 2),
    "zero3-local": (3, False, False, 1),
}
CI = ("ddp-sync", "ddp-local", "ddp-sync-acc2", "ddp-sync-buffers", "ddp-local-buffers", "layer")
SPAWNS = {(2, "ci"): CI, (2, "zero"): tuple(n for n in CASES if n not in CI), (4, "all"): (*CASES, "layer")}
LAYER_SHARDS = {2: ((5, 2), (6, 0)), 4: ((4, 0, 3, 1), (2, 3, 1, 2))}  # the layer alone, per pass: a rank may hold none


class Counted(nn.Module):
    """The BN CNN; its loss the mean cross-entropy; `seen` counts the samples trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_digits_net("bn_cnn", DIM, SEED).to(DTYPE)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += len(labels)
        logits = self.net.classifier(self.net.embedding(images))
        return F.cross_entropy(logits, labels)


def group_batch(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch group `group` of step `step`: BATCH float32 images (held exactly in float64) and labels."""
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.rand(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)


def without_seen(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "seen"}


@functools.cache
def reference(accumulation: int) -> dict[str, torch.Tensor]:
    """One process, torch's BatchNorm, each step's `accumulation` groups of BATCH images as its chunks."""
    model = Counted()
    batches = []
    for step in range(STEPS):
        groups = [group_batch(step, i) for i in range(accumulation)]
        batches.append((torch.cat([x for x, _ in groups]), torch.cat([y for _, y in groups])))
    ref = train_reference(model, adamw(decay_groups(model)), batches, pieces=accumulation,
                          loss_fn=lambda m, _, x, y: m(x, y))
    assert not any(isinstance(m, SyncBatchNorm) for m in model.modules())
    return without_seen(ref.state)


# ------------------------------------------------------------------------------------ worker
def _train(ctx: ParallelContext, name: str) -> dict[str, Any]:
    zero, sync, broadcast, accumulation = CASES[name]
    world, rank = ctx.world_size, ctx.rank
    parallel = ParallelConfig(zero=zero, sync_batchnorm=sync, broadcast_buffers=broadcast,
                              fsdp_wrap="net.features,net.project")
    engine = Engine(Counted, adamw, ctx, parallel)
    before = ctx.comm.stats.snapshot()
    for step in range(STEPS):
        parts = [group_batch(step, i) for i in range(accumulation)]
        engine.train_step([(x.tensor_split(world)[rank], y.tensor_split(world)[rank]) for x, y in parts])
    counted = counted_since(before, ctx.comm.stats.snapshot())
    return {"state": engine.full_state_dict(), "counted": counted,
            "synced_layers": sum(isinstance(m, SyncBatchNorm) for m in engine.model.modules())}


def layer_inputs(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per training pass of the layer test: the whole input [n, 3, 4, 4] (mean far from 0) and the weights
    of its loss Σ w·y."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(sum(sizes), 3, 4, 4, generator=g, dtype=DTYPE) * 2 + 30,
             torch.randn(sum(sizes), 3, 4, 4, generator=g, dtype=DTYPE)) for sizes in LAYER_SHARDS[world]]


def layer_rows(world: int, rank: int) -> list[slice]:
    """This rank's rows of each pass's input."""
    return [slice(sum(sizes[:rank]), sum(sizes[: rank + 1])) for sizes in LAYER_SHARDS[world]]


def new_layer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(3, momentum=0.3).to(DTYPE)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5), layer.bias.uniform_(-1, 1)
    return layer


def layer_pass(layer: nn.Module, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A training pass of `layer` per input (its running statistics updated each time; γ's and β's
    gradients accumulated), then eval on the last input: outputs, gradients and state."""
    out = {}
    for i, (x, w) in enumerate(inputs):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * w).sum().backward()
        out.update({f"y{i}": y.detach(), f"x{i}.grad": xi.grad})
    layer.eval()
    out["eval"] = layer(inputs[-1][0]).detach()
    return {**out, **{f"{k}.grad": p.grad for k, p in layer.named_parameters()}, **layer.state_dict()}


def _layer(ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """A BatchNorm2d alone on this rank's rows of `layer_inputs`."""
    layer = convert_sync_batchnorm(new_layer(), ctx.comm, ctx.group("dp_cp"))
    rows = layer_rows(ctx.world_size, ctx.rank)
    return layer_pass(layer, [(x[r], w[r]) for (x, w), r in zip(layer_inputs(ctx.world_size), rows)])


def _suite(world: int, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    ctx = init(ParallelConfig(), init_method=init_method())
    return run_each(lambda name: _layer(ctx) if name == "layer" else _train(ctx, name), names)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_suite)


def _params(world: int, group: str) -> list[Any]:
    marks = [] if group == "ci" else [pytest.mark.slow]
    return [pytest.param(world, group, name, marks=marks, id=f"world{world}-{name}")
            for name in SPAWNS[world, group] if name in CASES]


ALL = [p for key in SPAWNS for p in _params(*key)]


# ------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("world, group", [(2, "ci"), pytest.param(4, "all", marks=pytest.mark.slow)])
def test_layer_with_uneven_and_empty_shards(world: int, group: str, spawns: Spawns) -> None:
    """Each rank's outputs (training passes, then eval) and input gradients are the reference's rows;
    γ's and β's gradients sum over the ranks to the reference's; every rank's running statistics are
    the reference's."""
    runs = case_result(spawns.get((world, group), world, world, SPAWNS[world, group]), "layer")
    ref = layer_pass(new_layer(), layer_inputs(world))
    shared = ("running_mean", "running_var", "num_batches_tracked", "weight", "bias")
    passes = len(LAYER_SHARDS[world])
    for rank, run in enumerate(runs):
        rows = layer_rows(world, rank)
        mine = {k: ref[k][rows[i]] for i in range(passes) for k in (f"y{i}", f"x{i}.grad")}
        mine["eval"] = ref["eval"][rows[-1]]
        assert all(run[k].shape == v.shape for k, v in mine.items()), f"layer rank {rank}"
        expected = {**{k: ref[k] for k in shared}, **{k: v for k, v in mine.items() if v.numel()}}
        assert_params_close({k: run[k] for k in expected}, expected, 1e-12, f"layer rank {rank}")
    for name in ("weight.grad", "bias.grad"):
        torch.testing.assert_close(sum(run[name] for run in runs), ref[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world, group, name", ALL)
def test_batchnorm_cnn_on_uneven_shards(world: int, group: str, name: str, spawns: Spawns) -> None:
    zero, sync, broadcast, accumulation = CASES[name]
    runs = case_result(spawns.get((world, group), world, world, SPAWNS[world, group]), name)
    expected = reference(accumulation)
    shards = [len(part) for part in torch.arange(BATCH).tensor_split(world)]
    for rank, run in enumerate(runs):
        state = without_seen(run["state"])
        assert run["synced_layers"] == (len(CHANNELS) if sync else 0)
        if sync:
            assert_params_close(state, expected, TOL, f"{name} rank {rank}")
        else:  # each rank normalised its own shard: parameters and running statistics drift
            assert max_relative_error(state, expected) > DRIFT, f"{name} rank {rank}"
        # `seen`: with broadcasts every step starts from rank 0's count
        steps_before = STEPS - 1 if broadcast else 0
        assert int(run["state"]["seen"]) == accumulation * (steps_before * shards[0] + (STEPS - steps_before) * shards[rank])
    if not sync:
        stats = [{k: v for k, v in run["state"].items() if "running" in k} for run in runs]
        assert max_relative_error(stats[1], stats[0]) > DRIFT  # the ranks' statistics differ
    if zero == 0:
        _check_counts(runs[0]["counted"], runs[0]["state"], world, sync, broadcast, accumulation)


def _check_counts(counted: dict[str, dict[str, int]], state: dict[str, torch.Tensor], world: int, sync: bool,
                  broadcast: bool, accumulation: int) -> None:
    """Exact traffic of the BatchNorm statistics (an all-gather of 2C + 1 float64 per rank and layer,
    each forward) and of the buffer broadcasts (one per dtype run and step; rank 0 sends them)."""
    forwards = STEPS * accumulation
    gather = counted.get("all_gather/dp_cp", {"calls": 0, "payload_bytes": 0})
    assert gather["calls"] == (len(CHANNELS) * forwards if sync else 0)
    assert gather["payload_bytes"] == (forwards * sum(world * (2 * c + 1) * 8 for c in CHANNELS) if sync else 0)
    buffers = ["seen"] if sync else [k for k in state if "running" in k or "num_batches" in k or k == "seen"]
    sent = counted.get("broadcast/dp_cp", {"calls": 0, "wire_bytes": 0})
    assert sent["calls"] == (STEPS * len({state[k].dtype for k in buffers}) if broadcast else 0)
    assert sent["wire_bytes"] == (STEPS * sum(state[k].numel() * state[k].element_size() for k in buffers)
                                  if broadcast else 0)


# ------------------------------------------------------------------------------------ the digits task
DIGITS_BATCH = 16


def _digits_config(out: str, world: int, sync: bool) -> Any:
    """`--model digits` with `model.digits_net = "bn_cnn"`: 3 steps of 16 images, all of a rank's share in one micro-batch."""
    return load_config(None, {
        "model.preset": "digits", "model.digits_net": "bn_cnn", "model.dim": DIM, "log.out": out,
        "log.progress": "off", "log.eval_every": 0, "schedule.steps": STEPS, "schedule.warmup_steps": 1,
        "schedule.global_batch": DIGITS_BATCH, "schedule.micro_batch": DIGITS_BATCH // world,
        "parallel.dp": world, "parallel.sync_batchnorm": sync})


def _digits_run(out: str, world: int, sync: bool) -> dict[str, torch.Tensor]:
    return train(_digits_config(out, world, sync), dtype=DTYPE)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_digits_task_run_equals_one_process(world: int, tmp_path: Any) -> None:
    """The trainer's digits task, its data and schedule, in float64: parameters and running statistics."""
    one = train(_digits_config(str(tmp_path / "one"), 1, False), dtype=DTYPE)
    synced = run_distributed(_digits_run, world, str(tmp_path / "synced"), world, True)
    local = run_distributed(_digits_run, world, str(tmp_path / "local"), world, False)
    for rank in range(world):
        assert_params_close(synced[rank], one, TOL, f"digits bn_cnn at {world} ranks, rank {rank}")
        assert max_relative_error(local[rank], one) > DRIFT


# ------------------------------------------------------------------------------------ one process
def one_rank() -> tuple[Communicator, Group]:
    from datetime import timedelta

    return Communicator(0, timedelta(seconds=1)), Group("dp_cp", (0,), 0)


BN_CASES = {
    "1d-2D": (nn.BatchNorm1d, (7, 5), {}),
    "1d-3D-cumulative": (nn.BatchNorm1d, (4, 5, 3), {"momentum": None}),
    "2d": (nn.BatchNorm2d, (6, 3, 5, 4), {"momentum": 0.3}),
    "3d-no-affine": (nn.BatchNorm3d, (3, 2, 2, 3, 2), {"affine": False}),
    "2d-untracked": (nn.BatchNorm2d, (5, 4, 3, 3), {"track_running_stats": False}),
}


@pytest.mark.parametrize("name", BN_CASES)
def test_one_rank_is_torch_batchnorm(name: str) -> None:
    """Forward, all three gradients, running statistics and counter over 3 steps, then eval, in float64
    on inputs whose mean is far from 0 (where sums of squares would cancel)."""
    kind, shape, options = BN_CASES[name]
    torch.manual_seed(0)
    ref = kind(shape[1], **options).to(DTYPE)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5), ref.bias.uniform_(-1, 1)
    mine = kind(shape[1], **options).to(DTYPE)
    mine.load_state_dict(ref.state_dict())
    mine = convert_sync_batchnorm(mine, *one_rank())
    assert isinstance(mine, SyncBatchNorm)
    for _ in range(3):
        x = torch.randn(shape, dtype=DTYPE) * 3 + 50
        outputs, grads = [], []
        for module in (ref, mine):
            xi = x.clone().requires_grad_()
            out = module(xi)
            (out * torch.linspace(-1, 2, out.numel(), dtype=DTYPE).view_as(out)).sum().backward()
            outputs.append(out.detach())
            grads.append({"x": xi.grad, **{n: p.grad for n, p in module.named_parameters()}})
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-12)
        assert_params_close(grads[1], grads[0], 1e-9, f"{name} gradients")
    assert_params_close(mine.state_dict(), ref.state_dict(), 1e-12, f"{name} state")
    ref.eval(), mine.eval()
    x = torch.randn(shape, dtype=DTYPE)
    torch.testing.assert_close(mine(x), ref(x), rtol=1e-12, atol=1e-12)


def test_conversion_keeps_tensors_names_and_refuses_bad_input() -> None:
    model = BatchNormDigitsNet(DIM)
    before = dict(model.state_dict(keep_vars=True))
    converted = convert_sync_batchnorm(model, *one_rank())
    assert converted is model
    after = dict(model.state_dict(keep_vars=True))
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == len(CHANNELS)
    layer = model.features[1]
    with pytest.raises(ValueError, match="expected 4D input"):
        layer(torch.zeros(2, 32, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.zeros(1, 32, 1, 1))
    layer.eval()
    assert layer(torch.zeros(1, 32, 1, 1)).shape == (1, 32, 1, 1)  # running statistics: one sample is fine


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.sync_batchnorm": True, "parallel.dp_mode": "single-process"}, "needs dp_mode=ddp"),
    ({"parallel.sync_batchnorm": True, "parallel.pp": 2}, "reduces BatchNorm statistics over dp only"),
    ({"parallel.sync_batchnorm": True, "parallel.recompute": "full"}, "update the running ones twice"),
    ({"parallel.broadcast_buffers": True, "ps.servers": 1}, "parameter server's workers do not form"),
    ({"model.digits_net": "bn_cnn"}, "use it with --model digits"),
])
def test_refusals_are_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        load_config(None, overrides)
    assert "\n" not in str(caught.value)


def test_digits_task_option_builds_the_bn_cnn() -> None:
    """`model.digits_net` chooses the digits task's model where every run builds it (models/build.py)."""
    cfg = load_config(None, {"model.preset": "digits", "model.digits_net": "bn_cnn", "model.dim": DIM})
    model = build_seeded_model(cfg.model, cfg.seed)
    assert isinstance(model, BatchNormDigitsNet) and isinstance(build_meta_model(cfg.model), BatchNormDigitsNet)
    norms = [(name, m.num_features) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms == [("features.1", 32), ("features.4", 64), ("features.8", 64), ("project.1", 128)]
    plain = build_seeded_model(load_config(None, {"model.preset": "digits"}).model, 0)
    assert type(plain) is DigitsNet and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in plain.modules())


def test_description_line() -> None:
    """The run description says over how many samples BatchNorm normalises, and warns when ranks drift."""
    model = BatchNormDigitsNet(DIM)
    assert describe_batchnorm(model, 1, 32) is None and describe_batchnorm(build_digits_net("cnn", DIM, 0), 4, 8) is None
    assert describe_batchnorm(model, 2, 32) == (
        "4 BatchNorm layers normalise each rank's micro-batch of 32 samples and their running statistics drift "
        "apart: set parallel.sync_batchnorm = true to normalise over 64")
    convert_sync_batchnorm(model, *one_rank())
    assert describe_batchnorm(model, 4, 8) == "4 BatchNorm layers normalise over 4 ranks × micro-batch 8 = 32 samples (parallel.sync_batchnorm)"
