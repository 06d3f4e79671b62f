"""A run directory is ndtrain's or untouched (run/directory.py): another program's folder given as
`--out` is refused in one line with every one of its files byte-identical and nothing added, with
and without `--resume` or `--overwrite`; `--resume` without a checkpoint is refused before anything is
written; a new folder gets the marker; a run directory written before the marker existed still
resumes. Real `ndtrain train` processes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ndtrain.checkpoint.store import checkpoint_name
from ndtrain.run.directory import MARKER
from tests.helpers.runs import TINY_ARGS, corpus_file, ndtrain, one_error_line

FOREIGN_FILES = {
    "config.toml": b"[model]\nname = 'not ndtrain'\n",
    "metrics.jsonl": b'{"epoch": 1, "accuracy": 0.5}\n',
    "summary.json": b'{"best": 0.5}\n',
    "data/train.bin": bytes(range(256)) * 16,
    "data/meta.json": b'{"rows": 4096}\n',
}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder below `folder`: relative path -> SHA-256 of its bytes ("dir" for a folder)."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def train(out: Path, data: str, *more: str):
    return ndtrain("train", "--nproc", "1", "--data", data, "--out", str(out), "--steps", "2", "--save-every", "2",
                   *TINY_ARGS, *more)


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    folder = tmp_path / "their-folder"
    for name, content in FOREIGN_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


@pytest.mark.parametrize("flags", [(), ("--resume",), ("--overwrite",)], ids=["plain", "resume", "overwrite"])
def test_another_programs_folder_is_refused_and_left_byte_identical(tmp_path: Path, foreign: Path,
                                                                    flags: tuple[str, ...]) -> None:
    before = snapshot(foreign)
    line = one_error_line(train(foreign, corpus_file(tmp_path), *flags))
    assert "is not an ndtrain run directory" in line and "config.toml" in line and MARKER in line, line
    assert snapshot(foreign) == before


def test_resume_without_a_checkpoint_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new-run"
    line = one_error_line(train(out, corpus_file(tmp_path), "--resume"))
    assert "--resume: no checkpoint in" in line, line
    assert not out.exists()


def test_a_data_refusal_leaves_no_trace_in_a_new_or_empty_folder(tmp_path: Path) -> None:
    """The data are checked after the marker is written: a refusal there takes back what the run added."""
    (tmp_path / "short.txt").write_text("too short\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new-run", empty):
        line = one_error_line(train(out, str(tmp_path / "short.txt")))
        assert "too few" in line, line
    assert not (tmp_path / "new-run").exists() and list(empty.iterdir()) == []


def test_a_new_run_is_marked_and_an_unmarked_run_of_ours_still_resumes(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    out = tmp_path / "run"
    first = train(out, data)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / MARKER).read_text())["ndtrain"]
    (out / MARKER).unlink()  # as a run directory written before the marker existed
    again = train(out, data, "--resume", "--steps", "4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / MARKER).is_file() and (out / "checkpoints" / checkpoint_name(4)).is_dir()
