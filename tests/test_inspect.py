"""`ndtrain inspect RUN_DIR`: model, layout, step, tokens and per-tensor shapes of the newest verified checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.errors import UserError
from ndtrain.run.inspect import inspect_run, model_tensors
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.trainer import Trainer
from tests.helpers.runs import corpus_file, ndtrain, tiny_config


def test_inspect_names_layout_step_tokens_and_tensors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(corpus_file(tmp_path), str(run), **{"schedule.steps": 3, "parallel.dp": 1})
    Trainer(cfg, init(cfg.parallel)).run()
    proc = ndtrain("inspect", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    fields = dict(line.split(None, 1) for line in lines[: lines.index("tensors:")] if " " in line)
    assert fields["model"].strip() == "tiny"
    assert fields["checkpoint"].strip() == "step_00000003 (verified)"
    assert fields["step"].strip() == "3 of 3"
    assert fields["layout"].strip() == "dp=1 × cp=1 × pp=1 × tp=1, zero=0"
    assert fields["tokens"].strip() == f"{3 * 8 * 32:,}"  # steps × global batch × seq_len
    expected = build_model(load_config(run / "config.toml").model, 0).state_dict()
    tensors = model_tensors(run / "checkpoints" / "step_00000003")
    assert {name: shape for name, (shape, _) in tensors.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    assert {dtype for _, dtype in tensors.values()} == {"float32"}
    assert re.search(r"^  layers\.0\.attention\.wk\.weight +16×32 +float32$", proc.stdout, re.M)
    progress = json.loads((run / "checkpoints" / "step_00000003" / "progress.json").read_text())
    assert progress["tokens"] == 3 * 8 * 32


def test_inspect_without_checkpoint_and_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.toml").write_text('[model]\npreset = "tiny"\n')
    assert inspect_run(tmp_path / "fresh").endswith("checkpoint  none yet")
    with pytest.raises(UserError, match="is not an ndtrain run directory"):
        inspect_run(tmp_path)
