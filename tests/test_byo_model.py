"""`ndtrain.Trainer(config, model_fn=..., loss_fn=...)`: the README's "Bring your own model" example,
executed as written (one process), then resumed from its checkpoint by running it again with more steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.runs import corpus_file

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    section = README.read_text().split("## Bring your own model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_trains_checkpoints_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       one_thread: None) -> None:
    Path(corpus_file(tmp_path)).rename(tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    code = readme_example()
    exec(compile(code, "README.md", "exec"), {})
    summary = json.loads((tmp_path / "runs/byo/summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumed_from"] == 0 and summary["val_loss"] < 5.0
    assert (tmp_path / "runs/byo/checkpoints/latest").read_text().strip() == "step_00000020"
    progress = json.loads((tmp_path / "runs/byo/checkpoints/step_00000020/progress.json").read_text())
    assert progress["tokens"] == 20 * 8 * 64
    exec(compile(code.replace('"schedule.steps": 20', '"schedule.steps": 22'), "README.md", "exec"), {})
    summary = json.loads((tmp_path / "runs/byo/summary.json").read_text())
    assert summary["steps"] == 22 and summary["resumed_from"] == 20
