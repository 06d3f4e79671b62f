"""Who started this process, as the launcher's own variables say: rank, world size, rank on the host,
and where the ranks meet (the rendezvous store, served by rank 0).

Read in this order, the first that is present wins (a launcher run inside another, e.g. torchrun
under srun or mpirun inside a Slurm allocation, is the inner one; PMI_RANK without MPI_LOCALRANKID
in an srun step is srun's PMI-2 plugin, read as Slurm):

    launcher     rank / world size / rank on the host / ranks on the host
    torchrun     RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE           (rendezvous: torchrun's store, env://)
    Open MPI     OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
    MPICH, Intel MPI (Hydra)  PMI_RANK / PMI_SIZE / MPI_LOCALRANKID / MPI_LOCALNRANKS
    Slurm srun   SLURM_PROCID / SLURM_STEP_NUM_TASKS or SLURM_NTASKS / SLURM_LOCALID /
                 SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE at SLURM_NODEID (else
                 SLURM_NTASKS_PER_NODE, else the world size: an upper bound)

Slurm counts only inside an srun step (SLURM_STEP_ID set, below the special ids of the batch
script's and an interactive shell's own steps): a batch script also carries SLURM_PROCID=0 and the
job's SLURM_NTASKS, and a command run there directly is one process, not rank 0 of many.

Rendezvous of the MPI and Slurm launches: rank 0 serves a TCPStore at MASTER_ADDR:MASTER_PORT when
they are set; otherwise at the first host of the step's node list (SLURM_STEP_NODELIST, else
SLURM_JOB_NODELIST or SLURM_NODELIST: srun places task 0 on it), or on 127.0.0.1 when mpirun's ranks
all run on one host, and at port `DEFAULT_PORT`. mpirun spanning several hosts names none of them:
MASTER_ADDR is then required (a one-line error says so). Nothing here communicates or writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from ndtrain.errors import UserError

DEFAULT_PORT = 29500  # the rendezvous port of MPI and Slurm launches without MASTER_PORT (torchrun's default too)
LOOPBACK = "127.0.0.1"
SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # step ids from here up are Slurm's own (batch script, interactive, extern)

# launcher name → (rank, world size, local rank, local world size) variables; Slurm's are read apart
_MPI_VARIABLES = {
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


@dataclass(frozen=True)
class Launch:
    """This process's place in the world as its launcher set it ("none": a process of its own)."""

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    host: str | None = None  # the rendezvous host (rank 0's); None: the launcher names none
    port: int = DEFAULT_PORT
    host_from: str = ""  # where `host` came from, for messages

    @property
    def external(self) -> bool:
        """Started, with its peers, by mpirun or srun: every process runs `ndtrain` itself, no agent."""
        return self.launcher not in ("torchrun", "none") and self.world_size > 1

    def init_method(self) -> str:
        """The `torch.distributed.rendezvous` URL the ranks meet at."""
        if self.launcher in ("torchrun", "none"):
            return "env://"
        if self.host is None:
            raise UserError(
                f"{self.launcher} started {self.world_size} processes on several hosts and names none of them: "
                "set MASTER_ADDR to rank 0's host (e.g. mpirun -x MASTER_ADDR=HOST0 -x MASTER_PORT=29500)"
            )
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def detect(environ: Mapping[str, str]) -> Launch:
    """The launcher of the process whose environment is `environ` (see the module docstring)."""
    if "RANK" in environ:  # torchrun sets them all; a process given RANK alone is read as before, in a world of 1
        return Launch("torchrun", *_ints(environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                                         defaults=(None, 1, 0, 1)))
    for launcher, names in _MPI_VARIABLES.items():
        # srun's PMI-2 plugin sets PMI_RANK/PMI_SIZE too, without Hydra's MPI_LOCALRANKID: Slurm's then say more
        pmi_of_srun = launcher == "MPICH" and names[2] not in environ and _in_srun_step(environ)
        if names[0] in environ and not pmi_of_srun:
            rank, world, local_rank, local_world = _ints(environ, names, defaults=(None, None, 0, 1))
            host, where = _master_addr(environ)
            if host is None and local_world == world:
                host, where = LOOPBACK, f"all {world} ranks on this host"
            return _checked(Launch(launcher, rank, world, local_rank, local_world, host, _port(environ), where))
    if "SLURM_PROCID" in environ and _in_srun_step(environ):
        return _checked(_slurm(environ))
    return Launch("none")


def _slurm(environ: Mapping[str, str]) -> Launch:
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    rank, world, local_rank = _ints(environ, ("SLURM_PROCID", world_name, "SLURM_LOCALID"), defaults=(None, None, 0))
    per_node_name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if n in environ), None)
    local_world = world  # without srun's list: at most all of them (threads are then shared conservatively)
    if per_node_name is None and "SLURM_NTASKS_PER_NODE" in environ:
        (local_world,) = _ints(environ, ("SLURM_NTASKS_PER_NODE",))
    if per_node_name is not None:
        (node,) = _ints(environ, ("SLURM_NODEID",), defaults=(0,))
        counts = expand_counts(environ[per_node_name], per_node_name)
        if node >= len(counts):
            raise UserError(f"SLURM_NODEID={node} but {per_node_name}={environ[per_node_name]!r} lists "
                            f"{len(counts)} nodes: run ndtrain through srun")
        local_world = counts[node]
    host, where = _master_addr(environ)
    if host is None:
        lists = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        nodelist = next((n for n in lists if n in environ), None)
        if nodelist is not None:
            host, where = expand_hostlist(environ[nodelist], nodelist)[0], f"the first host of {nodelist}"
    return Launch("Slurm", rank, world, local_rank, local_world, host, _port(environ), where)


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step.isdigit() and int(step) < SLURM_SPECIAL_STEPS


def _master_addr(environ: Mapping[str, str]) -> tuple[str | None, str]:
    host = environ.get("MASTER_ADDR", "").strip()
    return (host, "MASTER_ADDR") if host else (None, "")


def _port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" not in environ:
        return DEFAULT_PORT
    (port,) = _ints(environ, ("MASTER_PORT",))
    if not 0 < port < 2**16:
        raise UserError(f"MASTER_PORT={port} is not a TCP port: give one in 1..65535")
    return port


def _ints(environ: Mapping[str, str], names: tuple[str, ...],
          defaults: tuple[int | None, ...] | None = None) -> list[int]:
    values = []
    for i, name in enumerate(names):
        default = None if defaults is None else defaults[i]
        text = environ.get(name)
        if text is None and default is not None:
            values.append(default)
            continue
        if text is None or not text.strip().isdigit():
            raise UserError(f"the launcher's variable {name}={text!r} is not a whole number: "
                            f"start ndtrain through the launcher, or unset the stray variable")
        values.append(int(text))
    return values


def _checked(launch: Launch) -> Launch:
    if not (0 <= launch.rank < launch.world_size and 0 <= launch.local_rank < launch.local_world_size
            and launch.local_world_size <= launch.world_size):
        raise UserError(
            f"{launch.launcher}'s variables disagree: rank {launch.rank} of {launch.world_size}, "
            f"rank {launch.local_rank} of {launch.local_world_size} on this host: start ndtrain through the launcher"
        )
    return launch


def expand_counts(text: str, name: str) -> list[int]:
    """Slurm's tasks per node, `2(x3),1` → [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise UserError(f"{name}={text!r} is not Slurm's tasks-per-node list (e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_hostlist(text: str, name: str = "hostlist") -> list[str]:
    """Slurm's compressed host list, `node[01-03,7],login` → node01, node02, node03, node7, login
    (zero padding kept; several bracket groups in one name expand as a product)."""
    hosts: list[str] = []
    for entry in _top_level_split(text, name):
        hosts += _expand_entry(entry, text, name)
    if not hosts:
        raise UserError(f"{name}={text!r} names no host: set MASTER_ADDR to rank 0's host")
    return hosts


def _top_level_split(text: str, name: str) -> list[str]:
    entries, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise UserError(f"{name}={text!r} has unbalanced brackets: set MASTER_ADDR to rank 0's host")
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise UserError(f"{name}={text!r} has unbalanced brackets: set MASTER_ADDR to rank 0's host")
    return [e.strip() for e in [*entries, current] if e.strip()]


def _expand_entry(entry: str, text: str, name: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", entry)
    if match is None:
        return [entry]
    prefix, ranges, rest = match.groups()
    tails = _expand_entry(rest, text, name) if rest else [""]
    names = []
    for part in ranges.split(","):
        bounds = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if bounds is None:
            raise UserError(f"{name}={text!r}: {part!r} is not a number or range: set MASTER_ADDR to rank 0's host")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        names += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return [f"{head}{tail}" for head in names for tail in tails]
