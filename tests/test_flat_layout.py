"""FlatLayout: the padded flat layout of ZeRO-1/2/3 (single process).

Across the N ranks, the segments cover every element of every parameter exactly once, never the
padding; each keeps the parameter's Placement and local shape, and its view is the right slice.
ZeroOptimizer (over DDP and ZeRO-2), Zero2DataParallel and FSDP hand them out after flattening."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndtrain import ParallelConfig, init
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.flat_layout import FlatLayout, Segment
from ndtrain.parallel.placement import Shard, name_parameters, place, placement_or_whole
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from ndtrain.parallel.data.zero2_gradients import Zero2DataParallel
from ndtrain.parallel.data.zero3_parameters import FullyShardedDataParallel


def _params() -> list[nn.Parameter]:
    shapes = [(3, 4), (5,), (2, 3, 2), (1,), (7,)]  # 37 elements: padded on 2, 4 and 5 ranks
    params = [nn.Parameter(torch.arange(float(i * 100), float(i * 100) + torch.Size(s).numel()).reshape(s)) for i, s in enumerate(shapes)]
    place(params[0], name="a.weight", shape=(3, 8), tp=Shard(dim=1, start=4, length=4, full=8))
    place(params[2], name="c.weight", shape=(2, 3, 2), pipeline_duplicate=True)
    return params


@pytest.mark.parametrize("ranks", [1, 2, 4, 5, 40])
def test_segments_cover_each_element_once_without_padding(ranks: int) -> None:
    params = _params()
    numel = sum(p.numel() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params] + [torch.full((-numel % ranks,), -1.0)])
    seen = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for rank in range(ranks):
        layout = FlatLayout(params, ranks, rank)
        assert layout.padded == flat.numel() and layout.padded % ranks == 0 and layout.padded - numel < ranks
        assert (layout.lo, layout.hi) == (rank * layout.size, (rank + 1) * layout.size)
        shard = flat[layout.lo : layout.hi].clone()
        segments = layout.segments(shard)
        assert sum(s.stop - s.start for s in segments) == layout.real
        for s in segments:
            p = params[s.index]
            assert s.placement == placement_or_whole(p) and s.local_shape == tuple(p.shape)
            assert torch.equal(s.flat_view, p.detach().reshape(-1)[s.start : s.stop])
            assert s.flat_view.data_ptr() == shard[s.offset :].data_ptr()  # a view of the shard, not a copy
            seen[s.index][s.start : s.stop] += 1
    assert all(bool((counts == 1).all()) for counts in seen)


def test_placement_is_read_at_construction_and_views_runs_follow_the_layout() -> None:
    params = _params()
    layout = FlatLayout(params, 4, 1)  # size 10: [10, 20) holds the ends of p0, all of p1, the start of p2
    place(params[2], pipeline_duplicate=False, replace=True)  # later changes do not reach the layout's record
    assert layout.placements[2].pipeline_duplicate and layout.placements[0].tp == Shard(1, 4, 4, 8)
    assert [(s.index, s.start, s.stop, s.offset) for s in layout.segments(torch.zeros(10))] == [(0, 10, 12, 0), (1, 0, 5, 2), (2, 0, 3, 7)]
    assert layout.runs([0, 1, 1, 0, 0]) == [(10, 12, 0), (12, 20, 1)]
    assert layout.runs([0, 1, 1, 0, 0], max_len=3) == [(10, 12, 0), (12, 15, 1), (15, 18, 1), (18, 20, 1)]
    flat = torch.arange(40.0)
    assert [v.shape for v in layout.views(flat)] == [p.shape for p in params]
    assert layout.views(flat)[3].item() == 29.0
    last = FlatLayout(params, 4, 3)  # [30, 40): 7 real elements, 3 of padding
    assert last.real == 7 and FlatLayout(params, 40, 39).real == 0


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    name_parameters(net)
    return net


def test_strategies_hand_out_segments_by_parameter_name_after_flattening() -> None:
    ctx = init(ParallelConfig())
    reference = _net()
    reference(torch.ones(2, 3)).sum().backward()
    values = {name: p.detach() for name, p in reference.named_parameters()}
    grads = {name: p.grad for name, p in reference.named_parameters()}

    def check(segments: list[Segment], expect: dict[str, torch.Tensor]) -> None:
        by_name = {s.placement.name: s for s in segments}
        assert len(by_name) == len(segments) and by_name.keys() == expect.keys()
        for name, s in by_name.items():
            assert s.local_shape == tuple(expect[name].shape) and (s.start, s.stop) == (0, expect[name].numel())
            assert torch.equal(s.flat_view, expect[name].reshape(-1)), name

    sgd = lambda groups: torch.optim.SGD(groups, lr=0.1)  # noqa: E731
    ddp = DistributedDataParallel(_net(), ctx)
    zero2 = Zero2DataParallel(_net(), ctx)
    zero1, zero2_optimizer = ZeroOptimizer(ddp, ctx, sgd), ZeroOptimizer(zero2, ctx, sgd)
    fsdp = FullyShardedDataParallel(_net(), ctx, wrap=["2"])
    for model in (ddp, zero2, fsdp):
        model(torch.ones(2, 3)).sum().backward()
    for segments, expect in [(zero1.segments(), values), (zero1.segments(grad=True), grads),
                             (zero2_optimizer.segments(), values), (zero2_optimizer.segments(grad=True), grads),
                             (zero2.segments(), grads), (fsdp.segments(), values), (fsdp.segments(grad=True), grads)]:
        check(segments, expect)
