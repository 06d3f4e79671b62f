"""The `ndtrain` command end to end: elastic launch, external torchrun, run directory, generate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.runs import TINY_4_STEPS as TINY, corpus_file, ndtrain


def test_train_with_nproc_then_generate(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = ndtrain("train", "--nproc", "2", "--data", corpus_file(tmp_path), "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp=2 × cp=1 × pp=1 × tp=1 on 2 cpu process(es), backend gloo" in proc.stdout
    assert "ndtrain: summary" in proc.stdout
    for name in ("config.toml", "metrics.jsonl", "loss.png", "summary.json", "checkpoints/latest"):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["comm_bytes_per_step"] > 0 and "val_loss" in records[-1]
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(records[-1]["val_loss"]))
    assert 0 <= records[-1]["val_accuracy"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 4 * 8 * 32
    assert summary["val_accuracy"] == records[-1]["val_accuracy"]
    assert "validation perplexity" in proc.stdout and "next-token accuracy" in proc.stdout

    gen = ndtrain("generate", str(out), "--prompt", "import ", "--max-new-tokens", "20")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("import ") and len(gen.stdout.rstrip("\n")) >= len("import ")


def test_runs_under_external_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "ext"
    proc = ndtrain(
        "--standalone", "--nproc-per-node", "2", "-m", "ndtrain", "train", "--data", corpus_file(tmp_path),
        "--out", str(out), *TINY, launcher=("-m", "torch.distributed.run"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


def test_worker_side_user_error_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    proc = ndtrain("train", "--nproc", "2", "--data", str(bad), "--out", str(tmp_path / "r"), *TINY)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and "line 2" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
