"""Safe loading: a crafted checkpoint whose pickles would create a file never runs that code."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.metadata import MetadataIndex

from ndtrain.checkpoint.manifest import MANIFEST, verify, write_manifest
from ndtrain.checkpoint.safe_pickle import SafePlanner, UnsafePickle, load_metadata, load_tensors
from tests.helpers.runs import corpus_file, ndtrain, one_error_line, train_cli as train


class CreatesFile:
    """Unpickled with arbitrary classes allowed, this opens (creates) `path` for writing."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest so the crafted checkpoint verifies: the manifest is no defence against tampering."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    write_manifest(checkpoint, manifest["step"], manifest["layout"])
    assert verify(checkpoint) is None


def test_the_payload_really_creates_the_file_when_unpickled_unsafely(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(CreatesFile(marker)))
    assert marker.exists()


def test_metadata_unpickler_refuses_foreign_classes(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafePickle, match="refused to load io.open"):
        load_metadata(pickle.dumps(CreatesFile(marker)))
    with pytest.raises(UnsafePickle, match="not Metadata"):
        load_metadata(pickle.dumps({"plain": [1, 2]}))
    assert not marker.exists()


def test_tensor_files_and_dcp_bytes_load_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    crafted = tmp_path / "rng.pt"
    torch.save({"torch": CreatesFile(marker)}, crafted)
    with pytest.raises(pickle.UnpicklingError):
        load_tensors(crafted)
    buffer = io.BytesIO()
    torch.save(CreatesFile(marker), buffer)
    buffer.seek(0)
    planner = SafePlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), [], MetadataIndex("x"), [], [])
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buffer)
    assert not marker.exists()


@pytest.fixture(scope="module")
def zero1_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-process ZeRO-1 run (each rank's slices in __N_0.distcp, besides .metadata and rng/) with a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("zero1")
    data = corpus_file(root)
    proc = train(root / "run", data, 2, "--zero", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run", data


CRAFTS = {
    "metadata": lambda c, m: (c / ".metadata").write_bytes(pickle.dumps(CreatesFile(m))),
    "rng": lambda c, m: torch.save({"torch": CreatesFile(m)}, c / "rng" / "rank00000.pt"),
    "distcp": lambda c, m: torch.save({"tensor": CreatesFile(m)}, c / "__1_0.distcp"),
}


def crafted_run(zero1_run: tuple[Path, str], tmp_path: Path, what: str) -> tuple[Path, Path]:
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(zero1_run[0], run)
    checkpoint = run / "checkpoints" / "step_00000002"
    CRAFTS[what](checkpoint, marker)
    reseal(checkpoint)
    return run, marker


@pytest.mark.parametrize("what", list(CRAFTS))
def test_crafted_checkpoint_does_not_run_code_on_resume(zero1_run: tuple[Path, str], tmp_path: Path, what: str) -> None:
    run, marker = crafted_run(zero1_run, tmp_path, what)
    proc = train(run, zero1_run[1], 4, "--zero", "1")
    error = one_error_line(proc)
    assert "cannot load checkpoint" in error and "step_00000002" in error
    assert not marker.exists()


@pytest.mark.parametrize("command", ["generate", "export"])
def test_crafted_metadata_does_not_run_code_on_generate_or_export(
    zero1_run: tuple[Path, str], tmp_path: Path, command: str
) -> None:
    run, marker = crafted_run(zero1_run, tmp_path, "metadata")
    args = [str(run), str(tmp_path / "model.safetensors")] if command == "export" else [str(run)]
    error = one_error_line(ndtrain(command, *args))
    assert "cannot load model weights" in error and "UnsafePickle: refused to load io.open" in error
    assert not marker.exists() and not (tmp_path / "model.safetensors").exists()
