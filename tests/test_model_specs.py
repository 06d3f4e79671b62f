"""Model-specific parallel plans live with the model: the strategies import no model and find a
model's plan through `parallel_spec`, so a new model brings its own without editing them.

Single process, no communication (the strategies' behaviour on the built-in and HF models is the
subject of test_tensor_parallel.py, test_pipeline_parity.py, test_recompute.py, test_hf_*.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.models.llama_parallel import LLAMA_PLAN, LlamaParallel
from ndtrain.parallel.model_spec import Heads, ModelParallel, parallel_spec
from ndtrain.parallel.pipeline import split_model
from ndtrain.parallel.model.recompute import apply_recompute
from ndtrain.parallel.model.tp_plan import default_plan

ROOT = Path(__file__).resolve().parent.parent / "ndtrain"
STRATEGIES = ("parallel/model/tp_plan.py", "parallel/pipeline/partition.py", "parallel/model/recompute.py")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return found | {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_import_no_model(strategy: str) -> None:
    """A strategy learns a model only through `parallel.model_spec`: nothing comes from ndtrain.models."""
    models = {m for m in imported_modules(ROOT / strategy) if m.startswith("ndtrain.models")}
    assert not models, models


def test_lookup_per_kind_of_model() -> None:
    llama = build_model(ModelConfig(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64), 0)
    spec = parallel_spec(llama)
    assert isinstance(spec, LlamaParallel) and spec.tp_plan() is LLAMA_PLAN
    assert spec.heads() == Heads(4, 2, 8, type(llama.layers[0].attention), ("wk", "wv"))
    assert parallel_spec(nn.Sequential(nn.Linear(2, 2))) is None
    assert parallel_spec([nn.Linear(2, 2)]) is None


class TwoBlocks(nn.Module):
    """A model of its own, unknown to every strategy, bringing its plan through `parallel_spec()`."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def parallel_spec(self) -> ModelParallel:
        return TwoBlocksParallel(self)


class TwoBlocksParallel(ModelParallel):
    def tp_plan(self) -> dict[str, str]:
        return {"blocks.*.0": "colwise", "blocks.*.1": "rowwise"}

    def selective_unit(self, block: nn.Module) -> nn.Module:
        return block[0]


def test_a_new_model_brings_its_own_plan() -> None:
    """Its shipped tp plan and its selective-recompute unit are used; what it does not override is refused
    in one line naming it (pipeline), exactly as for a model the strategies know."""
    model = TwoBlocks()
    assert default_plan(model) == {"blocks.*.0": "colwise", "blocks.*.1": "rowwise"}
    x = torch.randn(3, 4)
    want = model(x)
    apply_recompute(model, "selective")
    assert all("forward" in vars(block[0]) and "forward" not in vars(block[1]) for block in model.blocks)
    assert torch.equal(model(x), want)
    with pytest.raises(UserError, match="pipeline parallel is not supported for TwoBlocks"):
        split_model(model, init(ParallelConfig()), loss_fn=lambda out, targets: out.sum())


def test_no_plan_names_the_model() -> None:
    with pytest.raises(UserError, match="no built-in tp plan for Sequential: pass a plan"):
        default_plan(nn.Sequential(nn.Linear(2, 2)))
