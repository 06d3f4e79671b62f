"""Verified checkpoints: manifest, damage detection, fallback to the newest verified one, rotation, --overwrite."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint.store import load_model_weights
from ndtrain.checkpoint.manifest import MANIFEST, choose, obsolete, verify, write_manifest
from ndtrain.config import load_config
from ndtrain.models.llama import build_model
from tests.helpers.runs import corpus_file, train_cli as train


def flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(len(data), middle + count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- manifest and rotation on hand-made checkpoint directories (no processes) ----------------

def fake_checkpoint(directory: Path, step: int) -> Path:
    path = directory / f"step_{step:08d}"
    (path / "rng").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (path / "rng" / "rank00000.pt").write_bytes(b"rng" * 10)
    write_manifest(path, step, {"dp": 1, "cp": 1, "pp": 1, "tp": 1, "zero": 0})
    return path


def test_manifest_lists_every_file_with_size_and_hash(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 3)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["layout"]["dp"] == 1
    assert set(manifest["versions"]) == {"ndtrain", "torch"}
    assert sorted(manifest["files"]) == ["__0_0.distcp", "rng/rank00000.pt"]
    assert manifest["files"]["__0_0.distcp"]["size"] == 1024
    assert verify(path) is None


@pytest.mark.parametrize("damage, expected", [
    (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * 10), "file __0_0.distcp has 10 bytes, the manifest says 1024"),
    (lambda p: flip(p / "__0_0.distcp", 1), "file __0_0.distcp does not match its SHA-256"),
    (lambda p: (p / "rng" / "rank00000.pt").unlink(), "missing file rng/rank00000.pt"),
    (lambda p: (p / MANIFEST).unlink(), "missing manifest.json"),
    (lambda p: (p / MANIFEST).write_text("{not json"), "unreadable manifest.json"),
], ids=["truncated", "flipped", "missing-file", "missing-manifest", "bad-manifest"])
def test_verify_names_what_is_wrong(tmp_path: Path, damage, expected: str) -> None:
    path = fake_checkpoint(tmp_path, 1)
    damage(path)
    problem = verify(path)
    assert problem is not None and problem.startswith(expected), problem


def test_choose_takes_the_newest_verified_and_ignores_partial(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    shutil.copytree(tmp_path / "step_00000006", tmp_path / "step_00000008.partial")
    flip(tmp_path / "step_00000006" / "__0_0.distcp")
    choice = choose(tmp_path)
    assert choice.path == tmp_path / "step_00000004"
    assert [(p.name, why.split(" ")[0]) for p, why in choice.damaged] == [("step_00000006", "file")]


@pytest.mark.parametrize("keep", [1, 2])
def test_rotation_never_deletes_the_newest_verified(tmp_path: Path, keep: int) -> None:
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    flip(tmp_path / "step_00000004" / "__0_0.distcp")  # the newest is damaged: it does not count as kept
    (tmp_path / "step_00000005.partial").mkdir()       # a crash's leftover: not a checkpoint at all
    doomed = obsolete(tmp_path, keep, verified=tmp_path / "step_00000003")
    expected = {1: ["step_00000002", "step_00000001"], 2: ["step_00000001"]}[keep]
    assert [p.name for p in doomed] == expected
    # With nothing verified there is nothing to rotate.
    for step in (1, 2, 3):
        flip(tmp_path / f"step_{step:08d}" / "__0_0.distcp")
    assert obsolete(tmp_path, keep, verified=tmp_path / "none") == []


# ---- end to end: 2 processes, the CLI, one run made once and copied per case ----------------

@pytest.fixture(scope="module")
def made_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-process dp run of 4 steps with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("made")
    data = corpus_file(root)
    proc = train(root / "run", data, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000004"]
    return root / "run", data


def copy_run(made_run: tuple[Path, str], tmp_path: Path) -> tuple[Path, Path, str]:
    run = tmp_path / "run"
    shutil.copytree(made_run[0], run)
    return run, run / "checkpoints", made_run[1]


def final_parameters_are_finite(run: Path) -> bool:
    cfg = load_config(run / "config.toml")
    model = build_model(cfg.model, cfg.seed)
    load_model_weights(choose(run / "checkpoints").path, model)
    return all(torch.isfinite(p).all() for p in model.parameters())


DAMAGES = {
    "truncated-distcp": (lambda c: (c / "__0_0.distcp").write_bytes((c / "__0_0.distcp").read_bytes()[:1000]),
                         "file __0_0.distcp has 1000 bytes"),
    "flipped-distcp": (lambda c: flip(c / "__1_0.distcp"), "file __1_0.distcp does not match its SHA-256"),
    "flipped-metadata": (lambda c: flip(c / ".metadata"), "file .metadata does not match its SHA-256"),
    "flipped-rng": (lambda c: flip(c / "rng" / "rank00001.pt"), "file rng/rank00001.pt does not match its SHA-256"),
}


# CI damages a data file and the metadata; flipping another data file or an RNG file is the same check, `slow`
SLOW_DAMAGES = {"flipped-distcp", "flipped-rng"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_DAMAGES else c for c in DAMAGES])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_verified(
    made_run: tuple[Path, str], tmp_path: Path, case: str
) -> None:
    run, checkpoints, data = copy_run(made_run, tmp_path)
    damage, reason = DAMAGES[case]
    damage(checkpoints / "step_00000004")
    proc = train(run, data, 6, "--set", "checkpoint.keep=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines()  # besides a short run's capped default warmup
                if line.startswith("ndtrain: warning:") and "default warmup" not in line]
    assert len(warnings) == 1 and "step_00000004' is damaged (" + reason in warnings[0], proc.stderr[-3000:]
    assert "ndtrain: resuming at step 2" in proc.stdout
    # Nothing verified was deleted; the damaged step 4 was rewritten by the resumed run.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]
    assert all(verify(checkpoints / f"step_{s:08d}") is None for s in (2, 4, 6))
    assert (checkpoints / "latest").read_text().strip() == "step_00000006"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert final_parameters_are_finite(run)


def test_deleted_latest_resumes_from_the_newest_verified(made_run: tuple[Path, str], tmp_path: Path) -> None:
    run, checkpoints, data = copy_run(made_run, tmp_path)
    (checkpoints / "latest").unlink()
    proc = train(run, data, 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoints/latest' is missing: using the newest verified checkpoint step_00000004" in proc.stderr
    assert "ndtrain: resuming at step 4" in proc.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    assert final_parameters_are_finite(run)


def test_no_verified_checkpoint_is_an_error_until_overwrite(made_run: tuple[Path, str], tmp_path: Path) -> None:
    run, checkpoints, data = copy_run(made_run, tmp_path)
    for step in (2, 4):
        (checkpoints / f"step_{step:08d}" / MANIFEST).unlink()
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    proc = train(run, data, 6)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and "step_00000004, step_00000002" in errors[0] and "--overwrite" in errors[0]
    assert "Traceback" not in proc.stderr
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing touched
    proc = train(run, data, 2, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ndtrain: starting" in proc.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
    assert verify(checkpoints / "step_00000002") is None
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
