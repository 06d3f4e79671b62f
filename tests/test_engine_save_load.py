"""`Engine.save(path)` / `Engine.load(path)`: verified checkpoints without private flags, any layout.

Under the writing layout everything comes back (continuing after a load is bit-identical to never
stopping); across layouts (ZeRO-1 at 2 ranks ↔ one process) everything comes back too, optimizer
state included (tests/test_resharding.py covers the layout matrix).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import ParallelConfig, load_config
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from tests.helpers.runner import init_method, run_distributed


def make_engine(ctx, parallel: ParallelConfig) -> Engine:
    cfg = load_config(None, {"model.preset": "tiny"})
    return Engine(lambda: build_model(cfg.model, 0), lambda groups: torch.optim.AdamW(groups, lr=1e-2), ctx, parallel,
                  scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)))


def batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 256, (2, 2, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _zero1_worker(root: str, expected_from_one_process: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ctx = init(ParallelConfig(zero=1), init_method=init_method())
    rank = ctx.rank
    loaded = make_engine(ctx, ParallelConfig(zero=1))
    assert loaded.load(f"{root}/one")["step"] == 2 and loaded.scheduler.last_epoch == 2
    for name, tensor in expected_from_one_process.items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    engine = make_engine(ctx, ParallelConfig(zero=1))
    for step in range(2):
        engine.train_step(batches(step, rank))
    saved = params(engine)
    checkpoint = engine.save(f"{root}/zero1")
    assert checkpoint.name == "step_00000002" and (checkpoint / "rng" / f"rank{rank:05d}.pt").is_file()
    engine.train_step(batches(2, rank))
    resumed = make_engine(ctx, ParallelConfig(zero=1))
    progress = resumed.load(f"{root}/zero1")
    assert progress["step"] == 2 and resumed.scheduler.last_epoch == 2
    resumed.train_step(batches(2, rank))
    for name, tensor in params(engine).items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name  # exact: the optimizer state came back
    return saved


def test_save_and_load_across_zero1_two_ranks_and_one_process(tmp_path: Path, one_thread: None) -> None:
    one = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    for step in range(2):
        one.train_step(batches(step, 0))
    one.save(tmp_path / "one")
    zero1 = run_distributed(_zero1_worker, 2, str(tmp_path), params(one))
    assert all(torch.equal(zero1[0][k], zero1[1][k]) for k in zero1[0])
    single = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    assert single.load(tmp_path / "zero1")["step"] == 2 and single.optimizer.state  # AdamW's moments came back
    for name, tensor in zero1[0].items():
        assert torch.equal(single.model.state_dict()[name], tensor), name
    with pytest.raises(UserError, match="no checkpoint in"):
        single.load(tmp_path / "absent")


def test_load_of_one_checkpoint_verifies_it(tmp_path: Path) -> None:
    engine = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    engine.train_step(batches(0, 0))
    checkpoint = engine.save(tmp_path)
    fresh = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    assert fresh.load(checkpoint)["step"] == 1 and fresh._steps == 1
    for name, tensor in params(engine).items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    progress = checkpoint / "progress.json"
    progress.write_text(progress.read_text().replace('"step": 1', '"step": 7'))
    with pytest.raises(UserError, match=r"does not verify \(file progress.json does not match its SHA-256"):
        fresh.load(checkpoint)
