"""Issue 29, item 3: every refusal a layout or an HF model folder can meet is decided by the launcher,
before any worker starts and before the run folder is made (`--out` a new path stays absent), in one
line with exit status 2, with `--check` as without.

Layouts are dry-run on the meta-device model (ndtrain/run/layout_check.py): heads vs tp, a sequence
context parallel cannot split, fewer layers than pipeline stages. HF folders' weight files are checked
against the config's model (ndtrain/models/hf_weights.py): a truncated file, a header length of 2^62,
a tensor of the wrong shape, pickled weights only (never unpickled)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from tests.helpers.runs import ndtrain

TINY = ["--model", "tiny", "--steps", "2", "--set", "log.progress=false"]
LAYOUTS = {
    "heads-vs-tp": (["--nproc", "2", "--tp", "2", "--set", "model.n_heads=3", "--set", "model.n_kv_heads=3",
                     "--set", "model.dim=48"], "model.n_heads=3 is not divisible by tp=2"),
    "sequence-vs-cp": (["--nproc", "2", "--cp", "2", "--seq-len", "30"], "sequence length 30 is not divisible by 2·cp = 4"),
    "layers-vs-pp": (["--nproc", "4", "--pp", "4", "--global-batch", "4", "--micro-batch", "1"],
                     "2 layers cannot fill 4 pipeline stages"),
}


def refused_without_trace(tmp_path: Path, args: list[str], fragment: str) -> None:
    out = tmp_path / "new-run"
    proc = ndtrain("train", *args, "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ndtrain: error: "), proc.stderr[-3000:]
    assert fragment in proc.stderr, proc.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())


CI_REFUSALS = {("heads-vs-tp", True), ("sequence-vs-cp", False), ("layers-vs-pp", True)}  # each case once; both
# commands (train, --check) take the same path, so the other three are slow


@pytest.mark.parametrize(("case", "check"), [
    pytest.param(case, check, id=f"{case}-{'check' if check else 'train'}",
                 marks=[] if (case, check) in CI_REFUSALS else [pytest.mark.slow])
    for case in LAYOUTS for check in (False, True)])
def test_layout_refusals_come_from_the_launcher(tmp_path: Path, case: str, check: bool) -> None:
    args, fragment = LAYOUTS[case]
    refused_without_trace(tmp_path, [*TINY, *args, *(["--check"] if check else [])], fragment)


# ------------------------------------------------------------------------------------ HF model folders
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.hf import hf_dir, hf_dir_config

    model = transformers.AutoModelForCausalLM.from_config(hf_dir_config("llama"))
    return hf_dir(tmp_path_factory.mktemp("hf"), "llama", weights=model)


def truncated(folder: Path) -> None:
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def huge_header(folder: Path) -> None:
    file = folder / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 2**62) + file.read_bytes()[8:])


def wrong_shape(folder: Path) -> None:
    from tests.helpers.hf import hf_dir_config

    config = hf_dir_config("llama")
    config.intermediate_size = 48
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder / "other"))
    shutil.move(folder / "other" / "model.safetensors", folder / "model.safetensors")
    shutil.rmtree(folder / "other")


def pickled_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not to be unpickled")


HF_CASES = {
    "truncated": (truncated, "it is truncated"),
    "header-2^62": (huge_header, "header length 4611686018427387904 exceeds the file's"),
    "wrong-shape": (wrong_shape, "'model.layers.0.mlp.down_proj.weight' has shape [32, 48] in the weights"),
    "pickled-only": (pickled_only, "only weights are pickled (pytorch_model.bin), which ndtrain never unpickles: "
                                   "convert them to safetensors"),
}


CI_HF_CASES = ("truncated", "pickled-only")  # the other damages take the same check (safetensors header, shapes): slow


@pytest.mark.parametrize("case", [pytest.param(case, marks=[] if case in CI_HF_CASES else [pytest.mark.slow])
                                  for case in HF_CASES])
def test_hf_weight_files_are_checked_by_the_launcher(tmp_path: Path, good_folder: Path, case: str) -> None:
    damage, fragment = HF_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(good_folder, folder)
    damage(folder)
    args = ["--model", f"hf:{folder}", "--nproc", "1", "--steps", "2"]
    refused_without_trace(tmp_path, args, fragment)


def test_a_good_hf_folder_passes_the_checks(tmp_path: Path, good_folder: Path) -> None:
    proc = ndtrain("train", "--check", "--model", f"hf:{good_folder}", "--nproc", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
