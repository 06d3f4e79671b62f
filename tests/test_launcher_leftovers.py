"""A launcher killed mid-run leaves nothing outside its run directory: the workers' torchrun error files
live in RUN_DIR/logs/.launch-PID (launch.py), not in a temporary folder, and the next launch into the
run removes the folder of a launcher no longer alive. Real processes: the launcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ndtrain.launch import LAUNCH_FOLDER
from tests.helpers.processes import RUN_ARGS, TIMEOUT_S, Run, alive, poll
from tests.helpers.runs import corpus_file


def test_a_killed_launcher_leaves_nothing_outside_its_run(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    data = corpus_file(tmp_path)
    run = Run(tmp_path / "run", ["--nproc", "2", "--data", data, *RUN_ARGS, "--steps", "100000", "--save-every", "0"],
              env=env)
    poll(lambda: (run.out / "metrics.jsonl").exists(), "training to start", run)
    workers = run.workers()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=TIMEOUT_S)
    poll(lambda: not any(alive(pid) for pid in workers.values()), "the workers to die with the launcher", timeout=30)
    assert not list(scratch.glob("ndtrain-launch-*"))
    left = run.out / "logs" / f"{LAUNCH_FOLDER}{run.proc.pid}"
    assert left.is_dir()  # inside the run: the next launch's to remove
    again = Run(tmp_path / "run", ["--nproc", "2", "--data", data, *RUN_ARGS, "--steps", "1"], env=env)
    assert again.wait() == 0, again.stderr()[-3000:]
    assert not left.exists() and not list((run.out / "logs").glob(LAUNCH_FOLDER + "*"))
    assert not list(scratch.glob("ndtrain-launch-*"))
