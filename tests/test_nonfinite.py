"""The non-finite guard (fp32/bf16): a NaN loss on ONE rank stops every rank before the optimizer
step, naming the step, with parameters and optimizer state untouched; with `skip_nonfinite` every
rank skips that step and training goes on. Through `Engine` on 2 ranks (ZeRO 0, 1, 2; bf16), and
end to end through `ndtrain train` with a learning rate that blows the model up.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine, NonFiniteError
from ndtrain.dist.mesh import init
from tests.helpers.models import adamw, make_llama, micro_batches
from tests.helpers.runner import init_method, run_distributed

POISONED_STEP = 1  # 0-based: the second step's loss is NaN on rank 1 only
CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16")]


def _run(ctx: Any, zero: int, precision: str, skip: bool) -> dict[str, Any]:
    parallel = ParallelConfig(zero=zero, precision=precision)
    poison = [False]

    def model_fn() -> torch.nn.Module:
        model = make_llama()
        model.register_forward_hook(lambda m, i, loss: loss * float("nan") if poison[0] else loss)
        return model

    engine = Engine(model_fn, adamw, ctx, parallel, grad_clip=1.0, skip_nonfinite=skip)
    out: dict[str, Any] = {"skipped": [], "error": None}
    for step in range(3):
        poison[0] = step == POISONED_STEP and ctx.rank == 1
        if step == POISONED_STEP:
            out["before"] = engine.full_state_dict()
            out["opt_before"] = _tensors(engine.optimizer.state_dict())
        try:
            result = engine.train_step(micro_batches(step, ctx.rank, ctx.world_size, 1))
        except NonFiniteError as e:
            out["error"] = (e.step, str(e))
            break
        out["skipped"].append(result.skipped)
        if step == POISONED_STEP:
            out["after_skip"] = engine.full_state_dict()
    out["final"] = engine.full_state_dict()
    out["opt_final"] = _tensors(engine.optimizer.state_dict())
    out["skipped_steps"] = engine.skipped_steps
    return out


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) optimizer state dict, copied, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state.detach().clone()]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return [torch.tensor(float(state))] if isinstance(state, (int, float)) else []


def _suite(skip: bool) -> dict[tuple[int, str], dict[str, Any]]:
    ctx = init(ParallelConfig(), init_method=init_method())
    return {(zero, precision): _run(ctx, zero, precision, skip) for zero, precision in CASES}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_on_one_rank_stops_every_rank_before_the_update() -> None:
    for rank, out in enumerate(run_distributed(_suite, 2, False)):
        for case, run in out.items():
            assert run["error"] is not None, (rank, case)
            step, message = run["error"]
            assert step == POISONED_STEP + 1, (rank, case, step)
            assert message.startswith("step 2: loss is nan"), message
            assert "before the optimizer step" in message and "optim.skip_nonfinite = true" in message
            assert _equal(run["final"], run["before"]), (rank, case)  # nothing updated
            assert len(run["opt_final"]) == len(run["opt_before"]) > 0, (rank, case)
            assert all(torch.equal(a, b) for a, b in zip(run["opt_final"], run["opt_before"])), (rank, case)
            assert all(torch.isfinite(v).all() for v in run["final"].values())


def test_skip_nonfinite_skips_the_step_on_every_rank_and_goes_on() -> None:
    for rank, out in enumerate(run_distributed(_suite, 2, True)):
        for case, run in out.items():
            assert run["error"] is None, (rank, case, run["error"])
            assert run["skipped"] == [False, True, False], (rank, case)
            assert run["skipped_steps"] == 1
            assert _equal(run["after_skip"], run["before"]), (rank, case)
            assert not _equal(run["final"], run["before"]), (rank, case)  # the next step trained
            assert all(torch.isfinite(v).all() for v in run["final"].values())


# ------------------------------------------------------------------------------------ end to end
def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ndtrain", "train", "--model", "tiny", "--steps", "4", "--save-every", "1",
           "--out", str(out), "--set", "log.progress=false", "--set", "log.log_every=1",
           "--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=4", *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ndtrain: error:")]


def test_huge_lr_stops_naming_the_step_without_a_checkpoint_of_it(tmp_path: Path) -> None:
    # lr 1e30 (a short run: the default warmup is capped, so the first step is at 1e30): step 1 makes the weights huge, step 2's gradient norm is NaN
    run = _train(tmp_path / "run", "--set", "optim.lr=1e30")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = _error_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("ndtrain: error: step 2: loss is "), run.stderr
    assert "the newest checkpoint is step_00000001;" in lines[0], lines[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))


def test_skip_nonfinite_run_completes_counting_skipped_steps(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", "--set", "optim.lr=1e30", "--set", "optim.skip_nonfinite=true")
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_steps"] == 3  # every step after the first
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records if "skipped" in r] == [False, True, True, True]
    from ndtrain.checkpoint.store import load_model_weights
    from ndtrain.config import config_from_dict
    from ndtrain.models.llama import build_model

    model = build_model(config_from_dict({"model": {"preset": "tiny"}}).model, seed=0)
    load_model_weights(tmp_path / "run" / "checkpoints" / "step_00000004", model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_lr_is_refused_before_training(tmp_path: Path, value: str) -> None:
    run = _train(tmp_path / "run", "--set", f"optim.lr={value}")
    assert run.returncode == 2 and _error_lines(run.stderr) == [
        f"ndtrain: error: config key 'optim.lr' must be a finite number, got {value}"], run.stderr
    assert not (tmp_path / "run").exists()
