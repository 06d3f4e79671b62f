"""`ndtrain export`: the whole model of a run, from any layout, as one safetensors file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ndtrain.config import load_config
from ndtrain.dist.mesh import init
from ndtrain.trainer import Trainer
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file, ndtrain, one_error_line, tiny_config

LAYOUTS = {"dp2": {}, "zero3": {"parallel.zero": 3}, "pp2": {"parallel.pp": 2}}


def _train_worker(data: str, out: str, parallel: dict[str, object]) -> dict[str, torch.Tensor]:
    cfg = tiny_config(data, out, **{"schedule.steps": 3, **parallel})
    trainer = Trainer(cfg, init(cfg.parallel, init_method=init_method()))
    trainer.run()
    return trainer.engine.full_state_dict()  # gathered under zero=3; this stage's parameters under pp


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=[pytest.mark.slow] if layout == "dp2" else [])
                                    for layout in LAYOUTS])  # dp2 is what zero3's gathered export also covers
def test_export_equals_the_trained_model(tmp_path: Path, layout: str) -> None:
    run = tmp_path / "run"
    ranks = run_distributed(_train_worker, 2, corpus_file(tmp_path), str(run), LAYOUTS[layout])
    trained = {name: tensor for rank in ranks for name, tensor in rank.items()}
    out = tmp_path / "model.safetensors"
    proc = ndtrain("export", str(run), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000003" in proc.stdout
    exported = load_file(out)
    assert sorted(exported) == sorted(trained) and len(exported) == 21
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
    with safe_open(out, framework="pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["model_config"]) == dataclasses.asdict(load_config(run / "config.toml").model)
    assert metadata["step"] == "3"


def test_export_bad_inputs_are_one_line_exit_2(tmp_path: Path) -> None:
    cases = {
        "not a run": (tmp_path, "is not an ndtrain run directory"),
        "no checkpoint": (tmp_path / "fresh", "has no checkpoint yet"),
    }
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.toml").write_text('[model]\npreset = "tiny"\n')
    for run, expected in cases.values():
        assert expected in one_error_line(ndtrain("export", str(run), str(tmp_path / "m.safetensors")))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out, expected in ((blocker / "m.safetensors", "is not a directory"), (tmp_path, "is a directory")):
        assert expected in one_error_line(ndtrain("export", str(tmp_path / "fresh"), str(out)))
    assert not (tmp_path / "m.safetensors").exists()
