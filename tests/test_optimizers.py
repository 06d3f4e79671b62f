"""`optim.name` (AdamW, SGD, Adafactor: torch.optim's own) and `schedule.lr_scheduler` (cosine, linear,
constant, wsd) with warmup, from the config (run/optimizers.py).

- The multipliers at exact steps; cosine is the schedule of every earlier run.
- The warmup: the default is capped below a short run with one warning line, a given one at or past
  the run's steps is refused in one line.
- Parity, float64: the engine built from the config's optimizer and schedule on 2 ranks (SGD under dp2,
  ZeRO-1 and ZeRO-3; Adafactor under dp2 and pp2) equals single-process torch.optim.SGD / Adafactor;
  each case saves at step 2 and resumes bit-identically; SGD's checkpoint (momentum) written under
  ZeRO-1 loads into one process and continues the reference run; Adafactor's factored moments are
  refused in one line where parameters are sharded (config, checkpoint).
- The parameter server (whole tensors on its servers) runs SGD and Adafactor like one process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.cli.commands import build_parser, main, train_config
from ndtrain.config import ParallelConfig, PSConfig, TrainConfig, load_config
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.models.llama import build_model
from ndtrain.ps.engine import PSEngine, check_ps_config
from ndtrain.run.optimizers import lr_lambda, lr_multiplier, optimizer_factory
from tests.helpers.layouts import DTYPE, MAX_NORM, MODEL, State, batch
from tests.helpers.models import shard
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import decay_groups, train_reference
from tests.helpers.runner import case_result, init_method, run_distributed, run_each

STEPS = 4  # 2, a checkpoint, 2 more
LR = {"sgd": 0.1, "adafactor": 1e-2}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd-dp2": ("sgd", dict(dp=2)),
    "sgd-zero1": ("sgd", dict(dp=2, zero=1)),
    "sgd-zero3": ("sgd", dict(dp=2, zero=3)),
    "adafactor-dp2": ("adafactor", dict(dp=2)),
    "adafactor-pp2": ("adafactor", dict(dp=1, pp=2)),
}


# ------------------------------------------------------------------------------------ schedules
def test_multipliers_at_exact_steps() -> None:
    m = lambda step, kind, warmup=2, total=12, fraction=0.25: lr_multiplier(step, warmup, total, 0.1, kind, fraction)
    for kind in ("cosine", "linear", "constant", "wsd"):
        assert (m(0, kind), m(1, kind)) == (0.5, 1.0)  # linear warmup: (step + 1) / warmup
        assert m(2, kind) == 1.0  # the peak right after the warmup
    assert m(7, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert m(12, "cosine") == pytest.approx(0.1) and m(11, "cosine") > 0.1  # cosine: min at `total`, as before
    assert m(11, "linear") == pytest.approx(0.1)  # linear: min at the last step
    assert m(6, "linear") == pytest.approx(1 - 0.9 * 4 / 9)
    assert [m(s, "constant") for s in range(2, 12)] == [1.0] * 10
    # wsd: 12 steps, the last ⌈0.25·12⌉ = 3 decay from 1 (step 9) to 0.1 (step 11)
    assert [m(s, "wsd") for s in range(2, 10)] == [1.0] * 8
    assert (m(10, "wsd"), m(11, "wsd")) == (pytest.approx(0.55), pytest.approx(0.1))
    assert m(1, "wsd", warmup=10, fraction=0.5) == 0.2 and m(10, "wsd", warmup=10, fraction=0.5) == 1.0  # decay waits


def test_cosine_default_is_the_earlier_schedule() -> None:
    cfg = load_config(None, {})
    assert (cfg.schedule.lr_scheduler, cfg.warmup_steps(), cfg.optim.name) == ("cosine", 30, "adamw")
    earlier = lambda s: (s + 1) / 30 if s < 30 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 30) / 170)))
    assert [lr_lambda(cfg)(s) for s in range(201)] == [earlier(s) for s in range(201)]
    adamw = optimizer_factory(cfg)([{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["betas"] == (0.9, 0.95)


def test_default_warmup_is_capped_with_one_warning_and_a_given_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = train_config(build_parser().parse_args(["train", "--steps", "3"]))
    assert cfg.warmup_steps() == 0 and lr_lambda(cfg)(0) == 1.0  # `--steps 3` peaks at step 0, not at lr/10
    assert main(["train", "--steps", "3", "--out", str(tmp_path / "run"), "--check"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and "default warmup of 30 steps" in err[0] and "schedule.steps=3" in err[0]
    assert load_config(None, {"schedule.steps": 50}).warmup_steps() == 30  # a run longer than the warmup keeps it
    digits = load_config(None, {"model.preset": "digits", "schedule.steps": 7})
    assert (digits.warmup_steps(), load_config(None, {"model.preset": "digits"}).warmup_steps()) == (0, 10)
    assert load_config(None, {"schedule.steps": 3, "schedule.warmup_steps": 2}).warmup_warning() is None
    with pytest.raises(UserError, match=r"schedule.warmup_steps=3 must be >= 0 and below schedule.steps=3"):
        load_config(None, {"schedule.steps": 3, "schedule.warmup_steps": 3})


@pytest.mark.parametrize("argv, message", [
    (["--optim", "adafactor", "--zero", "1"], "parallel.zero=1 splits them into flat shards"),
    (["--optim", "adafactor", "--zero", "3"], "parallel.zero=3 splits them into flat shards"),
    (["--optim", "adafactor", "--tp", "2"], "parallel.tp=2 splits matrices"),
    (["--optim", "sgd", "--set", "parallel.flat_adamw=true"], "does nothing with optim.name=sgd"),
    (["--steps", "5", "--warmup-steps", "9"], "schedule.warmup_steps=9 must be >= 0 and below schedule.steps=5"),
])
def test_refusals_are_one_line(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nproc", "4", "--out", str(tmp_path / "run"), "--check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------ parity
def run_config(name: str) -> TrainConfig:
    return load_config(None, {"optim.name": name, "optim.lr": LR[name], "optim.grad_clip": MAX_NORM,
                              "schedule.steps": STEPS, "schedule.warmup_steps": 1, "schedule.lr_scheduler": "linear"})


def make_engine(cfg: TrainConfig, ctx: Any, parallel: ParallelConfig) -> Engine:
    return Engine(lambda: build_model(MODEL, seed=0).to(DTYPE), optimizer_factory(cfg), ctx, parallel,
                  scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)), grad_clip=MAX_NORM)


def reference(name: str, dtype: torch.dtype = DTYPE) -> State:
    """Single process, whole global batch: torch's optimizer of `name` under the config's schedule."""
    cfg = run_config(name)
    model = build_model(MODEL, seed=0).to(dtype)
    optimizer = optimizer_factory(cfg)(decay_groups(model))
    assert type(optimizer) is {"sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}[name]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return train_reference(model, optimizer, map(batch, range(STEPS)), clip=MAX_NORM, scheduler=scheduler).state


def _case(root: str, case: str) -> dict[str, Any]:
    name, layout = CASES[case]
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    cfg = run_config(name)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    step = lambda engine, s: engine.train_step(shard(batch(s), rank, dp, 2))
    engine = make_engine(cfg, ctx, parallel)
    for s in range(2):
        step(engine, s)
    engine.save(f"{root}/{case}")
    for s in range(2, STEPS):
        step(engine, s)
    resumed = make_engine(cfg, ctx, parallel)
    assert resumed.load(f"{root}/{case}")["step"] == 2 and resumed.scheduler.last_epoch == 2
    for s in range(2, STEPS):
        step(resumed, s)
    state, again = engine.full_state_dict(), resumed.full_state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state), "resume is not exact"
    refused = None
    if name == "adafactor":  # its factored moments do not load into flat shards (an Engine user's own ZeRO-1)
        zero1 = ParallelConfig(dp=2, zero=1)
        try:
            make_engine(run_config("sgd"), init(zero1, init_method=init_method()), zero1).load(f"{root}/{case}")
        except UserError as e:
            refused = str(e)
    return {"state": state, "refused": refused}


def _cases(root: str) -> dict[str, Any]:
    return run_each(lambda case: _case(root, case), CASES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("optimizers")
    return root, run_distributed(_cases, 2, str(root), timeout=300)


@pytest.fixture(scope="module")
def references() -> dict[str, State]:
    return {name: reference(name) for name in LR}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_under_layout_equals_single_process_torch(
        case: str, runs: tuple[Path, list[dict[str, Any]]], references: dict[str, State]) -> None:
    name, _ = CASES[case]
    merged: State = {}
    for run in case_result(runs[1], case):
        merged.update(run["state"])
        if name == "adafactor":
            assert run["refused"] is not None and "\n" not in run["refused"]
            assert "not element-wise" in run["refused"] and "zero=0, tp=1" in run["refused"]
    initial = {k: v.to(DTYPE) for k, v in build_model(MODEL, seed=0).state_dict().items()}
    moved = max(((references[name][k] - initial[k]).abs().max() / initial[k].abs().max()).item() for k in initial)
    assert moved > 1e-3  # the optimizer moved the weights: the parity check can fail
    assert_params_close(merged, references[name], 1e-9, case)


@pytest.mark.usefixtures("one_thread")
def test_sgd_checkpoint_of_zero1_continues_in_one_process(runs: tuple[Path, list[dict[str, Any]]],
                                                          references: dict[str, State]) -> None:
    """Momentum is element-wise: the ZeRO-1 checkpoint of step 2 loads into one process and its steps 3-4
    land on the reference's (without the momentum they would not)."""
    cfg, parallel = run_config("sgd"), ParallelConfig(dp=1)
    engine = make_engine(cfg, init(parallel), parallel)
    assert engine.load(runs[0] / "sgd-zero1")["step"] == 2
    assert {k for state in engine.optimizer.state.values() for k in state} == {"momentum_buffer"}
    for s in range(2, STEPS):
        engine.train_step([batch(s)])
    assert_params_close(engine.full_state_dict(), references["sgd"], 1e-9, "sgd zero1 -> one process")
    # the same checkpoint without its momentum: the parity above can fail
    fresh = make_engine(cfg, init(parallel), parallel)
    fresh.load(runs[0] / "sgd-zero1")
    for state in fresh.optimizer.state.values():
        state.clear()
    for s in range(2, STEPS):
        fresh.train_step([batch(s)])
    with pytest.raises(AssertionError):
        assert_params_close(fresh.full_state_dict(), references["sgd"], 1e-9, "no momentum")


# ------------------------------------------------------------------------------------ parameter server
def ps_config(name: str) -> TrainConfig:
    cfg = run_config(name)
    cfg.ps = PSConfig(servers=1, mode="sync")
    return cfg


def ps_batches(worker: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return shard(batch(step), worker, 2, 2)


def _ps(name: str) -> State:
    """2 workers and 1 server (sync, fp32: the parameter server's only precision): the server keeps whole
    tensors, so Adafactor is the single-process one."""
    cfg = ps_config(name)
    ctx = init(init_method=init_method())
    engine = PSEngine(lambda: build_model(MODEL, seed=0), optimizer_factory(cfg), ctx, cfg,
                      lr_lambda=lr_lambda(cfg))
    for s in range(STEPS):
        engine.train_step([] if engine.is_server else ps_batches(ctx.rank, s))
    return {k: v.detach().clone() for k, v in engine.model.named_parameters()}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(LR))
def test_parameter_server_runs_the_optimizer_like_one_process(name: str) -> None:
    check_ps_config(ps_config(name), 3)  # neither optimizer is refused there
    workers, expected = run_distributed(_ps, 3, name)[:2], reference(name, torch.float32)
    for params in workers:
        assert_params_close(params, expected, 1e-5, f"ps {name}")
