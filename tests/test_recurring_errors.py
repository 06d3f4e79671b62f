"""Failures a restart would meet again end the run after one attempt, in one line; lost peers restart.

The rule is ndtrain/failures.py's. Each run below is the real command (`ndtrain train --nproc 2
--max-restarts 3`) in a subprocess: a corrupt weight file, a symbolic link in the checkpoint tree,
a model that cannot be built, a full disk and a read-only file system during a save must each exit
2 after one attempt (rank 0's start lines in its log are counted), within 15 s of the failure (the
rank log's timestamp of it), with exactly one `ndtrain: error:` line and no traceback on stderr. A
SIGKILLed worker still restarts the group, and the surviving rank's communication error stays in
its rank log: the console shows the launcher's restart line only.

The full-disk and read-only cases (one test: they share a run) mount a small tmpfs on RUN_DIR/checkpoints (root only; skipped
otherwise) and unmount it whatever happens.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ndtrain.checkpoint.manifest import verify
from ndtrain.errors import UserError
from ndtrain.failures import PeerFailed, lost_peer, recurring_cause
from tests.helpers.processes import RUN_ARGS, Run, newest_step, poll
from tests.helpers.runs import TINY_ARGS, corpus_file, ndtrain, one_error_line

FAILURE_TO_EXIT_S = 15
START_LINE = re.compile(r"^\S+ \S+ ndtrain: rank 0 \(pid \d+, elastic restart (\d+)\) logging to", re.M)
ERROR_LINE = re.compile(r"^(\S+ \S+) ndtrain: (?:error: |a failure a restart would meet again)", re.M)


# ---- what a run must end like -------------------------------------------------------------
def rank0_log(out: Path) -> str:
    path = out / "logs" / "rank_0.log"
    return path.read_text() if path.exists() else ""


def train_once(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, str, float]:
    """`ndtrain train --nproc 2 --max-restarts 3 ...`: the process, what it added to rank 0's log, and
    when it ended."""
    before = len(rank0_log(out))
    proc = ndtrain("train", "--nproc", "2", "--max-restarts", "3", "--out", str(out), *TINY_ARGS, *args)
    return proc, rank0_log(out)[before:], time.time()


def ended_in_one_attempt(proc: subprocess.CompletedProcess, log: str, ended: float) -> str:
    """The single error line of a run that ended after at most one attempt (none when the launcher
    refused it before starting workers), within 15 s of the failure its rank log records."""
    line = one_error_line(proc)
    attempts = [int(n) for n in START_LINE.findall(log)]
    assert attempts in ([], [0]), f"attempts {attempts}:\n{proc.stderr[-3000:]}"
    assert "restarting the workers" not in proc.stderr, proc.stderr[-3000:]
    if attempts:
        failed = ERROR_LINE.search(log)
        assert failed, log[-3000:]
        at = datetime.strptime(failed.group(1), "%Y-%m-%d %H:%M:%S")
        assert ended - at.timestamp() <= FAILURE_TO_EXIT_S + 1, (at, ended)
    return line


# ---- the rule, exception by exception --------------------------------------------------------
def test_the_rule_sorts_exceptions() -> None:
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    def raised_while(handling: BaseException, error: BaseException) -> BaseException:
        try:
            raise handling
        except BaseException:
            try:
                raise error
            except BaseException as e:
                return e

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/x.distcp")
    inside_dcp = CheckpointException("write", {1: (raised_while(full, RuntimeError("unexpected pos 704 vs 598")), None)})
    assert "No space left on device" in recurring_cause(inside_dcp)
    assert "'/ckpt/x.distcp'" in recurring_cause(inside_dcp)
    assert recurring_cause(OSError(errno.EROFS, "Read-only file system")) is not None
    assert recurring_cause(UserError("bad value")) == "bad value"
    assert "not valid safetensors" in recurring_cause(SafetensorError("Error while deserializing header: header too large"))
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4")
    wrapped = raised_while(gloo, RuntimeError("collective #15 barrier on axis 'world' failed"))
    for restartable in (wrapped, PeerFailed("rank 1 failed"), torch.distributed.DistNetworkError("store gone")):
        assert recurring_cause(restartable) is None and lost_peer(restartable)
    bug = ValueError("a bug")
    assert recurring_cause(bug) is None and not lost_peer(bug)
    assert recurring_cause(OSError(errno.ECONNRESET, "Connection reset")) is None


# ---- corrupt weights ------------------------------------------------------------------------
def truncated(path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def huge_header(path: Path) -> Path:
    path.write_bytes(struct.pack("<Q", 2**62) + b'{"w": {}}')
    return path


@pytest.mark.parametrize("corrupt", [truncated, pytest.param(huge_header, marks=pytest.mark.slow)],  # the same path: one in CI
                         ids=["truncated", "header-2^62"])
def test_corrupt_init_from_weights_end_the_run_in_one_attempt(tmp_path: Path, corrupt) -> None:
    weights = corrupt(tmp_path / "model.safetensors")
    proc, log, ended = train_once(tmp_path / "run", "--data", corpus_file(tmp_path), "--steps", "2",
                                  "--init-from", str(weights))
    line = ended_in_one_attempt(proc, log, ended)
    assert "cannot read" in line and str(weights) in line, line


def test_corrupt_hf_model_weights_end_the_run_in_one_attempt(tmp_path: Path) -> None:
    from tests.helpers.hf import hf_dir, hf_dir_config, transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        folder = hf_dir(tmp_path, "llama", transformers.AutoModelForCausalLM.from_config(hf_dir_config("llama")))
    weights = folder / "model.safetensors"
    weights.unlink()
    truncated(weights)
    proc, log, ended = train_once(tmp_path / "run", "--data", corpus_file(tmp_path), "--steps", "2",
                                  "--model", f"hf:{folder}", "--set", "model.seq_len=32")
    line = ended_in_one_attempt(proc, log, ended)
    assert str(folder) in line, line


# ---- a model that cannot be built -------------------------------------------------------------
def mismatched_hf_folder(root: Path) -> Path:
    """A Llama folder whose weights have another feed-forward width than its config.json says."""
    import json

    from tests.helpers.hf import hf_dir, hf_dir_config, transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        folder = hf_dir(root, "llama", transformers.AutoModelForCausalLM.from_config(hf_dir_config("llama")))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    return folder


def test_a_model_that_cannot_be_built_ends_the_run_in_one_attempt(tmp_path: Path) -> None:
    folder = mismatched_hf_folder(tmp_path)
    proc, log, ended = train_once(tmp_path / "run", "--data", corpus_file(tmp_path), "--steps", "2",
                                  "--model", f"hf:{folder}", "--set", "model.seq_len=32")
    line = ended_in_one_attempt(proc, log, ended)
    assert str(folder) in line, line


def test_building_a_model_that_cannot_be_built_is_a_user_error_keeping_its_cause(tmp_path: Path) -> None:
    """The worker's side, whatever the launcher checked before: transformers' RuntimeError becomes one line."""
    from ndtrain.checkpoint.run_model import build_run_model
    from ndtrain.config import ModelConfig

    folder = mismatched_hf_folder(tmp_path)
    with pytest.raises(UserError, match=rf"cannot build the model hf:{re.escape(str(folder))} \(llama\)") as refused:
        build_run_model(ModelConfig(preset=f"hf:{folder}", seq_len=32), seed=0)
    assert refused.value.__cause__ is not None  # its traceback goes to the rank log


# ---- checkpoint trees with symbolic links -----------------------------------------------------
def test_a_checkpoint_that_is_a_symlink_is_refused_on_resume(tmp_path: Path) -> None:
    out, data = tmp_path / "run", corpus_file(tmp_path)
    first, _, _ = train_once(out, "--data", data, "--steps", "4", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = out / "checkpoints" / "step_00000004"
    shutil.move(link, elsewhere / link.name)
    link.symlink_to(elsewhere / link.name)
    proc, log, ended = train_once(out, "--data", data, "--steps", "6", "--save-every", "2", "--resume")
    line = ended_in_one_attempt(proc, log, ended)
    assert f"{str(link)!r} is a symbolic link" in line, line
    assert link.is_symlink() and verify(elsewhere / link.name) is None  # neither replaced nor deleted through


@pytest.mark.serial  # the refusal is bounded in wall-clock seconds: `make test` runs it alone
def test_a_symlink_planted_during_a_run_is_refused_by_rotation(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", ["--nproc", "2", "--max-restarts", "3", "--data", corpus_file(tmp_path), *RUN_ARGS,
                                 "--steps", "200", "--set", "checkpoint.keep=1000"])
    poll(lambda: newest_step(run.out) >= 2, "checkpoint 2", run)
    moved = tmp_path / "elsewhere" / "step_00000001"
    moved.parent.mkdir()
    link = run.out / "checkpoints" / "step_00000001"
    shutil.move(link, moved)
    link.symlink_to(moved)
    planted = time.time()
    status = run.wait()
    proc = subprocess.CompletedProcess(run.proc.args, status, run.stdout(), run.stderr())
    line = ended_in_one_attempt(proc, rank0_log(run.out), time.time())
    assert f"{str(link)!r} is a symbolic link" in line, line
    assert time.time() - planted <= 60, "the next save did not look at the tree"
    assert link.is_symlink() and verify(moved) is None


# ---- a full disk, a read-only file system ----------------------------------------------------
@pytest.fixture
def checkpoints_on_tmpfs(tmp_path: Path) -> Iterator[tuple[Path, str, Path]]:
    """A finished 4-step run (checkpoints 2 and 4) whose checkpoints/ now lies on its own small tmpfs:
    (run directory, data, mount point)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    out, data = tmp_path / "run", corpus_file(tmp_path)
    first, _, _ = train_once(out, "--data", data, "--steps", "4", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = out / "checkpoints"
    saved = tmp_path / "saved"
    checkpoints.rename(saved)
    checkpoints.mkdir()
    size = 3 * sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) + 2**20
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(checkpoints)], check=True)
    try:
        shutil.copytree(saved, checkpoints, dirs_exist_ok=True, symlinks=True)
        yield out, data, checkpoints
    finally:
        if subprocess.run(["umount", str(checkpoints)]).returncode != 0:
            subprocess.run(["umount", "-l", str(checkpoints)], check=True)


def fill(mount: Path, leave: int) -> Path:
    """A file taking all but `leave` bytes of the file system at `mount`."""
    stats = os.statvfs(mount)
    filler = mount / "filler"
    filler.write_bytes(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))
    return filler


def test_a_full_disk_or_read_only_file_system_during_a_save_ends_in_one_line_and_loses_nothing(
    checkpoints_on_tmpfs: tuple[Path, str, Path],
) -> None:
    out, data, mount = checkpoints_on_tmpfs
    checkpoint_bytes = sum(f.stat().st_size for f in (mount / "step_00000004").rglob("*") if f.is_file())
    filler = fill(mount, leave=checkpoint_bytes // 3)
    proc, log, ended = train_once(out, "--data", data, "--steps", "6", "--save-every", "2", "--resume")
    line = ended_in_one_attempt(proc, log, ended)
    assert f"checkpoint step_00000006 does not fit on the file system mounted at {str(mount)!r}" in line, line
    assert "the save needs about" in line and "the newest verified checkpoint step_00000004 remains" in line, line
    assert not list(mount.glob("*.partial")), sorted(p.name for p in mount.iterdir())
    assert verify(mount / "step_00000004") is None

    filler.unlink()  # with space again, the same command resumes from the checkpoint that remained
    again, _, _ = train_once(out, "--data", data, "--steps", "6", "--save-every", "2", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at step 4" in again.stdout, again.stdout[-2000:]
    assert newest_step(out) == 6

    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    proc, log, ended = train_once(out, "--data", data, "--steps", "8", "--save-every", "2", "--resume")
    line = ended_in_one_attempt(proc, log, ended)
    assert f"cannot write checkpoint step_00000008 on the file system mounted at {str(mount)!r}" in line, line
    assert "Read-only file system" in line and "the newest verified checkpoint step_00000006 remains" in line, line


# ---- a lost peer is restarted, quietly ----------------------------------------------------------
def test_a_killed_peer_restarts_with_one_line_and_no_traceback_from_the_survivor(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", ["--nproc", "2", "--max-restarts", "3", "--data", corpus_file(tmp_path), *RUN_ARGS,
                                 "--steps", "10"])
    poll(lambda: newest_step(run.out) >= 3, "checkpoint 3", run)  # a checkpoint every step: the survivor
    os.kill(run.workers()[1], signal.SIGKILL)                      # is caught in a collective
    assert run.wait() == 0, run.stderr()[-3000:]
    stderr = run.stderr()
    assert "Traceback" not in stderr and "unexpected" not in stderr, stderr[-3000:]
    restarts = [line for line in stderr.splitlines() if "restarting the workers" in line]
    assert len(restarts) == 1 and restarts[0].startswith("ndtrain: rank 1 was killed by SIGKILL"), stderr[-3000:]
    assert f"{run.out / 'logs' / 'rank_1.log'}" in restarts[0]
    assert "resuming at step" in run.stdout()
