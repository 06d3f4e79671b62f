"""Learning-rate scaling (issue 33, item 3): `optim.lr_scaling = none|linear|sqrt` relative to
`optim.reference_batch`. The factor and its refusals; a digits run in one process whose schedule
trains at the scaled rate (every step's lr in metrics.jsonl is the scaled peak × the warmup/cosine
multiplier), records the peak in summary.json and prints the rule in its description."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from ndtrain.config import OptimConfig, load_config
from ndtrain.console import log
from ndtrain.dist.mesh import init
from ndtrain.errors import UserError
from ndtrain.run.optimizers import lr_multiplier
from ndtrain.trainer import Trainer

STEPS, BATCH, REFERENCE, LR = 3, 16, 4, 1e-3


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_factor(rule: str, factor: float) -> None:
    optim = OptimConfig(lr=LR, lr_scaling=rule, reference_batch=REFERENCE)  # type: ignore[arg-type]
    optim.validate()
    assert optim.lr_factor(BATCH) == factor and math.isclose(optim.scaled_lr(BATCH), LR * factor, rel_tol=1e-15)
    assert OptimConfig(lr=LR, lr_scaling="linear", reference_batch=32).scaled_lr(16) == LR / 2  # smaller batch: lower


def test_description_line() -> None:
    optim = OptimConfig(lr=3e-4, lr_scaling="linear", reference_batch=32)
    assert optim.describe_lr(64) == "lr 0.0003 × 2 (linear, global batch 64 / reference 32) = 0.0006"
    assert OptimConfig(lr=3e-4).describe_lr(64) == "lr 0.0003 (optim.lr_scaling = none)"


@pytest.mark.parametrize("overrides, message", [
    ({"optim.lr_scaling": "linear"}, "optim.lr_scaling='linear' needs optim.reference_batch"),
    ({"optim.lr_scaling": "sqrt", "optim.reference_batch": 0}, "optim.reference_batch must be > 0"),
    ({"optim.reference_batch": -8}, "optim.reference_batch must be > 0"),
    ({"optim.lr_scaling": "square"}, "optim.lr_scaling='square' is not one of none, linear, sqrt"),
])
def test_refusals_are_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        load_config(None, overrides)
    assert "\n" not in str(caught.value)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_run_trains_at_the_scaled_rate(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = load_config(None, {
        "model.preset": "digits", "log.out": str(out), "log.progress": "off", "log.every": 1, "log.eval_every": 0,
        "schedule.steps": STEPS, "schedule.global_batch": BATCH, "schedule.micro_batch": BATCH,
        "schedule.warmup_steps": 2, "optim.lr": LR, "optim.lr_scaling": "sqrt",
        "optim.reference_batch": REFERENCE, "parallel.dp": 1})
    peak = LR * 2.0
    lines, level = Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        summary = Trainer(cfg, init(cfg.parallel)).run()
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    assert math.isclose(summary["peak_lr"], peak, rel_tol=1e-15)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert sorted(lrs) == list(range(1, STEPS + 1))
    for step, lr in lrs.items():
        assert math.isclose(lr, peak * lr_multiplier(step - 1, 2, STEPS, cfg.schedule.min_lr_ratio), rel_tol=1e-12)
    assert "ndtrain: lr 0.001 × 2 (sqrt, global batch 16 / reference 4) = 0.002" in "\n".join(lines.messages)
