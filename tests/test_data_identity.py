"""Issue 29, item 6: a checkpoint records which data it was trained on (the token file's and the
tokenizer's fingerprint); resuming it on other data is refused in one line, before anything is
written, unless `--set data.allow_change=true`, which continues with the new data's first batch and
says so in one warning line."""

from __future__ import annotations

import json
from pathlib import Path

from ndtrain.data.identity import read_fingerprint
from ndtrain.run.data_identity import data_start_after_resume
from tests.helpers.runs import TINY_ARGS, ndtrain, one_error_line, write_jsonl, texts


def test_resume_on_other_data_is_refused_unless_allowed(tmp_path: Path) -> None:
    data_a = str(write_jsonl(tmp_path / "a.jsonl", texts(400, seed=1)))
    data_b = str(write_jsonl(tmp_path / "b.jsonl", texts(400, seed=2)))
    out = tmp_path / "run"

    def run(data: str, steps: int, *more: str):
        return ndtrain("train", "--nproc", "1", "--data", data, "--out", str(out), "--steps", str(steps), *TINY_ARGS, *more)

    first = run(data_a, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.endswith(".lock")}

    refused = one_error_line(run(data_b, 4, "--resume"))
    assert "step_00000002' was trained on other data" in refused and "data.allow_change=true" in refused
    assert {p: p.read_bytes() for p in files} == files  # nothing written: the old token file included

    allowed = run(data_b, 4, "--resume", "--set", "data.allow_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    warnings = [line for line in allowed.stderr.splitlines() if line.startswith("ndtrain: warning: resuming step 2")]
    assert len(warnings) == 1 and "restarts at the first batch of the new data" in warnings[0], allowed.stderr
    progress = json.loads((out / "checkpoints" / "step_00000004" / "progress.json").read_text())
    assert progress["data_start"] == 2  # step 2 trained on data B's first batch
    assert progress["data"] == read_fingerprint(out / "data")


def test_a_checkpoint_without_a_fingerprint_resumes_unchecked(tmp_path: Path) -> None:
    current = {"tokens": "b", "identity": "b", "source": "text file 'b'"}
    assert data_start_after_resume({"step": 3}, tmp_path, 3, current, allow_change=False) == (0, None)
    same = {"step": 3, "data": current, "data_start": 1}
    assert data_start_after_resume(same, tmp_path, 3, current, allow_change=False) == (1, None)
