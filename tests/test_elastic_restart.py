"""Elastic restart: a worker SIGKILLed at a random moment (during a step or during a checkpoint
save) is restarted with its group, the run resumes from the newest checkpoint by itself, exits 0,
reports one restart, and its final parameters are bit-identical to an uninterrupted run.

Also: a user error is not retried, and the launcher's sockets listen on loopback only and its
workers die with it (SIGKILL of the launcher leaves no orphans).

Every run is the real command (`python -m ndtrain train --nproc 2 ...`) in a subprocess with a
hard timeout; kill moments come from a seeded RNG; waiting is polling of files and /proc.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest
import torch

from ndtrain.checkpoint import load_model_weights
from ndtrain.config import load_config
from ndtrain.models.llama import build_model
from tests.test_trainer import corpus_file

T = TypeVar("T")
TIMEOUT_S = 240.0
STEPS = 20
RUN_ARGS = ["--model", "tiny", "--steps", str(STEPS), "--save-every", "1", "--set", "schedule.global_batch=16",
            "--set", "schedule.micro_batch=4", "--set", "log.progress=false", "--set", "data.eval_samples=8",
            "--set", "log.eval_every=0"]
LAYOUTS = {
    "dp2": ["--nproc", "2"],
    "zero1": ["--nproc", "2", "--zero", "1"],
    "zero3": ["--nproc", "2", "--zero", "3"],
    "pp2": ["--nproc", "2", "--pp", "2"],
    "dp2pp2": ["--nproc", "4", "--pp", "2"],
}
# (layout, moment, rank killed): every layout, both moments, both ranks.
FULL_TRIALS = [
    ("dp2", "step", 0), ("dp2", "save", 1), ("zero1", "step", 1), ("zero1", "save", 0), ("zero3", "step", 0),
    ("zero3", "save", 1), ("pp2", "step", 1), ("pp2", "save", 0), ("dp2", "step", 1), ("zero3", "save", 0),
    ("dp2pp2", "step", 3), ("dp2pp2", "save", 0),
]
CI_TRIALS = [("dp2", "save", 0), ("dp2", "step", 1)]  # one reference run, shared with test_preemption


# ---- running the command --------------------------------------------------------------------
class Run:
    """One `ndtrain train` subprocess with its output in files (no pipe can fill up and block it)."""

    def __init__(self, out: Path, args: list[str], launcher: tuple[str, ...] = ("-m", "ndtrain"),
                 env: dict[str, str] | None = None) -> None:
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = out.parent / f"{out.name}.stdout", out.parent / f"{out.name}.stderr"
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, *launcher, "train", "--out", str(out), *args],
                                         stdout=stdout, stderr=stderr, env=env)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise AssertionError(f"run {self.out} did not end within {TIMEOUT_S} s:\n{self.stderr()[-3000:]}") from None

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def workers(self) -> dict[int, int]:
        """Global rank → PID of the launcher's live worker processes."""
        ranks = {}
        for pid in children(self.proc.pid):
            env = read_environ(pid)
            if "RANK" in env and alive(pid):
                ranks[int(env["RANK"])] = pid
        return ranks


def train_args(data: str, layout: str) -> list[str]:
    return [*LAYOUTS[layout], "--data", data, *RUN_ARGS]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def read_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_tree(pid: int) -> None:
    for child in children(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def poll(condition: Callable[[], T], what: str, run: Run | None = None, timeout: float = TIMEOUT_S) -> T:
    """Wait (polling) until `condition()` is truthy; fail if the run ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"the run ended (status {run.proc.returncode}) before {what}:\n{run.stderr()[-3000:]}")
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def newest_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def saving_step(out: Path) -> int:
    """The step of a checkpoint being written now (a `.partial` directory), else 0."""
    partial = [p.name for p in (out / "checkpoints").glob("step_*.partial")]
    return max((int(name[5:13]) for name in partial), default=0)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    cfg = load_config(str(out / "config.toml"), {})
    model = build_model(cfg.model, cfg.seed)
    load_model_weights(out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip(), model)
    return model.state_dict()


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def restarts_reported(run: Run) -> int:
    match = re.search(r"elastic restarts\s+(\d+)", run.stdout())
    assert match, f"no summary:\n{run.stdout()[-2000:]}\n{run.stderr()[-3000:]}"
    return int(match.group(1))


class References:
    """Uninterrupted runs, one per layout, computed once per test session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = corpus_file(root)
        self._weights: dict[str, dict[str, torch.Tensor]] = {}

    def weights(self, layout: str) -> dict[str, torch.Tensor]:
        if layout not in self._weights:
            run = Run(self.root / f"reference-{layout}", train_args(self.data, layout))
            assert run.wait() == 0, run.stderr()[-3000:]
            assert restarts_reported(run) == 0
            self._weights[layout] = final_weights(run.out)
        return self._weights[layout]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    yield References(tmp_path_factory.mktemp("references"))


# ---- fault trials ---------------------------------------------------------------------------
def kill_trial(tmp_path: Path, references: References, layout: str, moment: str, rank: int, seed: int) -> None:
    at_step = random.Random(seed).randint(2, STEPS // 2)
    run = Run(tmp_path / f"{layout}-{moment}-rank{rank}-step{at_step}", train_args(references.data, layout))
    if moment == "step":
        poll(lambda: newest_step(run.out) >= at_step, f"checkpoint {at_step}", run)
    else:
        poll(lambda: saving_step(run.out) >= at_step, f"the save of a checkpoint >= {at_step}", run)
    os.kill(run.workers()[rank], signal.SIGKILL)
    assert run.wait() == 0, run.stderr()[-3000:]
    assert restarts_reported(run) == 1
    assert "resuming at step" in run.stdout() and "after elastic restart 1" in run.stdout()
    assert_bit_identical(final_weights(run.out), references.weights(layout))


@pytest.mark.parametrize("layout,moment,rank", CI_TRIALS)
def test_killed_worker_is_restarted_and_result_is_bit_identical(
    tmp_path: Path, references: References, layout: str, moment: str, rank: int
) -> None:
    kill_trial(tmp_path, references, layout, moment, rank, seed=CI_TRIALS.index((layout, moment, rank)))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(len(FULL_TRIALS)))
def test_fault_trials_all_layouts(tmp_path: Path, references: References, trial: int) -> None:
    layout, moment, rank = FULL_TRIALS[trial]
    kill_trial(tmp_path, references, layout, moment, rank, seed=100 + trial)


def test_restart_after_the_last_checkpoint_ends_cleanly(tmp_path: Path) -> None:
    """A worker killed after the final checkpoint: the restarted group finds the run complete, exits 0."""
    args = ["--nproc", "1", "--data", corpus_file(tmp_path), *RUN_ARGS, "--steps", "3"]
    first = Run(tmp_path / "run", args)
    assert first.wait() == 0, first.stderr()[-3000:]
    restarted = Run(tmp_path / "run", args, env={**os.environ, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted.wait() == 0, restarted.stderr()[-3000:]
    assert "ndtrain: the run was complete at step 3 before elastic restart 1" in restarted.stdout()


# ---- what is not retried, sockets, orphans --------------------------------------------------
def test_user_error_in_a_worker_is_not_retried(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    run = Run(tmp_path / "run", ["--nproc", "2", "--data", str(bad), "--max-restarts", "3", *RUN_ARGS])
    assert run.wait() == 2
    errors = [line for line in run.stderr().splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1 and "line 2" in errors[0], run.stderr()[-2000:]  # a retry would print it again
    assert "Traceback" not in run.stderr()


def listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the TCP sockets in LISTEN state owned by `pids`."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1])
    return found


LOOPBACK_HEX = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")


def test_sockets_on_loopback_and_no_orphans_after_launcher_sigkill(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--data", corpus_file(tmp_path), *RUN_ARGS, "--steps", "100000", "--save-every", "0"]
    run = Run(tmp_path / "run", args)
    poll(lambda: (run.out / "metrics.jsonl").exists(), "training to start", run)
    workers = run.workers()
    assert sorted(workers) == [0, 1]
    sockets = listening_sockets([run.proc.pid, *workers.values()])
    assert sockets, "no listening socket found: the check would prove nothing"
    assert all(address.startswith(LOOPBACK_HEX) for address in sockets), sockets
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=TIMEOUT_S)
    poll(lambda: not any(alive(pid) for pid in workers.values()), "the workers to die with the launcher", timeout=30)


@pytest.mark.slow
def test_external_torchrun_restarts_too(tmp_path: Path, references: References) -> None:
    """Nothing in the worker depends on our launcher: torchrun's own agent restarts it just as well."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                "-m", "ndtrain")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see README: pytorch/pytorch#135712
    run = Run(tmp_path / "run", ["--data", references.data, *RUN_ARGS], launcher=torchrun, env=env)
    poll(lambda: newest_step(run.out) >= 4, "checkpoint 4", run)
    os.kill(run.workers()[1], signal.SIGKILL)
    assert run.wait() == 0, run.stderr()[-3000:]
    assert restarts_reported(run) == 1
    assert_bit_identical(final_weights(run.out), references.weights("dp2"))
