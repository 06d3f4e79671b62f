"""Every parameter of a prepared model is placed, and re-placing is explicit (placement.py). Single process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.models.llama import build_model
from ndtrain.parallel import compose
from ndtrain.parallel.model.tp_plan import parallelize
from ndtrain.parallel.placement import (
    Placement, PlacementError, Shard, carry_placement, check_placed, name_parameters, place, placement_of,
    placement_or_whole,
)
from tests.helpers.models import fake_tp_ctx

MODEL = ModelConfig(preset="tiny", dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, seq_len=8)


def sgd(groups: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.1)


def test_a_parameter_a_transform_leaves_unplaced_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def recompute_that_adds_a_parameter(model: nn.Module, mode: object) -> nn.Module:
        model.add_module("adapter", nn.Linear(4, 4))  # made after the engine named the model, never placed
        return model

    monkeypatch.setattr(compose, "apply_recompute", recompute_that_adds_a_parameter)
    with pytest.raises(PlacementError, match=r"'adapter\.weight', 'adapter\.bias' have no Placement"):
        Engine(lambda: build_model(MODEL, seed=0), sgd, init(ParallelConfig(dp=1)), ParallelConfig(dp=1))


def test_check_names_the_first_unplaced_parameters_and_counts_the_rest() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))
    place(model[0].weight, name="0.weight")
    with pytest.raises(PlacementError, match=r"'0\.bias', '1\.weight', '1\.bias' and 2 more have no Placement"):
        check_placed(model)
    name_parameters(model)
    check_placed(model)


def test_an_engine_model_is_placed_everywhere_and_a_model_is_named_again_by_a_second_engine() -> None:
    model = build_model(MODEL, seed=0)
    for _ in range(2):  # the second Engine re-names the same parameters: an explicit re-placement
        engine = Engine(lambda: model, sgd, init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    assert {placement_of(p, n).name for n, p in engine.model.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_tensor_parallel_places_every_parameter_it_makes() -> None:
    model = build_model(MODEL, seed=0)  # 1 kv head over tp = 2: k and v replicated (ReplicatedHeadsLinear)
    name_parameters(model)
    parallelize(model, fake_tp_ctx(2))
    check_placed(model)
    k = model.get_parameter("layers.0.attention.wk.weight")
    assert placement_of(k) == Placement(name="layers.0.attention.wk.weight", shape=(8, 16))


def test_reading_an_unplaced_parameter_is_an_error_unless_asked_for_a_whole_one() -> None:
    param = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(PlacementError, match=r"parameter 'head\.weight' has no Placement"):
        placement_of(param, "head.weight")
    with pytest.raises(PlacementError, match=r"parameter of shape \(2, 3\) \(torch\.float32\) has no Placement"):
        placement_of(param)
    assert placement_or_whole(param) == Placement()


def test_a_second_placement_raises_and_the_explicit_re_placement_keeps_the_other_fields() -> None:
    param = place(nn.Parameter(torch.zeros(4)), name="w", shape=(8,), tp=Shard(0, 0, 4, 8))
    with pytest.raises(PlacementError, match=r"parameter 'w' is already placed .* place\(\.\.\., replace=True\)"):
        place(param, pipeline_duplicate=True)
    assert not placement_of(param).pipeline_duplicate
    place(param, pipeline_duplicate=True, replace=True)
    assert placement_of(param) == Placement(name="w", shape=(8,), tp=Shard(0, 0, 4, 8), pipeline_duplicate=True)


def test_carrying_a_record_onto_a_placed_parameter_raises() -> None:
    old = place(nn.Parameter(torch.zeros(4)), name="w", shape=(4,))
    new = carry_placement(nn.Parameter(torch.zeros(2)), old, tp=Shard(0, 0, 2, 4))
    assert placement_of(new) == Placement(name="w", shape=(4,), tp=Shard(0, 0, 2, 4))
    with pytest.raises(PlacementError, match="already placed"):
        carry_placement(new, old)
    bare = carry_placement(nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(4)), tp=Shard(0, 2, 2, 4))
    assert placement_of(bare) == Placement(tp=Shard(0, 2, 2, 4))  # tensor parallel on a bare model
