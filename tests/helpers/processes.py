"""The launcher in a subprocess: a `ndtrain train` run with its output in files, its workers found
through /proc, polling of the files it writes, its final weights, and uninterrupted reference runs
(computed once per session, shared by the elastic-restart and preemption tests)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from ndtrain.checkpoint.store import load_model_weights
from ndtrain.config import LaunchConfig, load_config
from ndtrain.models.llama import build_model
from tests.helpers.runs import corpus_file

T = TypeVar("T")
TIMEOUT_S = 240.0
# the reference runs: 20 steps of the tiny model, a checkpoint every step, in each layout below
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



def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Block until `path` exists and is not empty (the run is mid-training); fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        assert proc.poll() is None, f"the run ended before {path.name} appeared: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.1)


def no_restarts() -> list[str]:
    """Pin the run to one incarnation where the launcher can restart workers (elastic restarts)."""
    if "max_restarts" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return ["--set", "launch.max_restarts=0"]
    return []
