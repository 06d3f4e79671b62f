"""What `ndtrain train` does before any worker starts, in the launching process (or, under mpirun or
srun, in rank 0 while the others wait: cli/external.py): every check that can refuse the run (the
device and the processes this host holds, the layout on the meta-device model, an hf: folder, the
host's memory, the run directory, a live run's lock, resuming), then the run directory's marker and
the token file, so mistakes end in one line and exit status 2 before anything is written or any
worker starts. Nothing here communicates.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ndtrain.config import TrainConfig, dump_toml
from ndtrain.errors import UserError
from ndtrain.run.config_checks import parameter_count

if TYPE_CHECKING:
    import torch

# What a run writes into its directory (trainer.py) and the kind each must be.
MAX_PROCS_PER_CORE = 8  # CPU workers per core a local launch accepts
RUN_FILES = {"checkpoints": "folder", "config.toml": "file", "metrics.jsonl": "file", "summary.json": "file",
             "loss.png": "file", "timeline.json": "file", "logs": "folder", "layout-auto.json": "file"}


def prepare_run(cfg: TrainConfig, check: bool, local_nproc: int, local_rank: int = 0) -> None:
    """Refuse a run that cannot work, then claim the run directory and build the token file (with `check`
    (`--check`): validate only, write nothing, print the resolved config). `cfg.launch.nproc` is the
    world size; `local_nproc` of its processes run on this host, this one as `local_rank`."""
    from ndtrain.dist.mesh import resolve_backend, resolve_device

    device = resolve_device(cfg.parallel.device, local_rank)
    check_nproc(local_nproc, device)  # before the layout checks: they would name a dp no machine can run
    dp = cfg.parallel.resolve_dp(cfg.launch.nproc)
    if cfg.ps.servers:
        from ndtrain.ps.engine import check_ps_config

        dp = check_ps_config(cfg, cfg.launch.nproc)
    cfg.schedule.accumulation_steps(dp)
    resolve_backend(cfg.parallel.backend, device)
    from ndtrain.models.hf import check_hf_model, hf_path, is_hf_model

    if is_hf_model(cfg.model.preset):
        check_hf_model(hf_path(cfg.model.preset), cfg.model.seq_len, cfg.parallel, cfg.model.attention)
    from ndtrain.run.layout_check import check_layout_on_meta

    check_layout_on_meta(cfg, cfg.launch.nproc)  # heads vs tp, sequence vs cp, layers vs pp: before any folder
    check_host_memory(cfg, local_nproc)
    check_run_dir(cfg.log.out)
    from ndtrain.data.prepare import check_data
    from ndtrain.run.directory import check_owned, claimed, has_checkpoint, nothing_to_resume
    from ndtrain.run.lock import refuse_if_locked

    run_dir = Path(cfg.log.out)
    refuse_if_locked(run_dir)  # a live run's folder: named by its holder (reads only)
    check_owned(run_dir)  # another program's folder is never written into (--resume, --overwrite too)
    if cfg.checkpoint.resume and not cfg.ps.servers and not has_checkpoint(run_dir):
        raise nothing_to_resume(run_dir / "checkpoints")
    from ndtrain.run.data_identity import check_resume_data

    check_resume_data(cfg, run_dir)  # a checkpoint of other data: refused before the token file is rebuilt
    with claimed(run_dir, write=not check):  # the marker first; a refusal below takes back what was added
        check_data(cfg, write=not check)  # builds the token file once, before any worker starts
    if check:
        print(dump_toml(cfg), end="")


def check_nproc(nproc: int, device: torch.device) -> None:
    """Local workers this machine can hold: one per GPU on CUDA (NCCL refuses two ranks on one device),
    at most MAX_PROCS_PER_CORE per core on CPU (beyond that a run only thrashes, or exhausts the machine)."""
    import torch

    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UserError(f"--nproc {nproc} needs {nproc} GPUs on CUDA (one process per GPU), this machine has "
                            f"{gpus}: use --nproc {gpus} or fewer")
        return
    cores = os.cpu_count() or 1
    if nproc > MAX_PROCS_PER_CORE * cores:
        raise UserError(f"--nproc {nproc} is more than {MAX_PROCS_PER_CORE} processes per core on this machine's "
                        f"{cores} cores: use --nproc {MAX_PROCS_PER_CORE * cores} or fewer")


def check_host_memory(cfg: TrainConfig, local_nproc: int) -> None:
    """Each local worker first builds the whole fp32 model on the host (then shards or moves it):
    local_nproc × 4Ψ bytes is the least the run needs, so more than this machine's memory cannot run."""
    params = parameter_count(cfg.model)
    need = local_nproc * 4 * params
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UserError(
            f"the model has {params:,} parameters: {local_nproc} workers × 4 bytes each is {need / 2**30:,.1f} GiB, "
            f"more than this machine's {have / 2**30:,.1f} GiB: use smaller model sizes or fewer processes"
        )


def check_run_dir(out: str) -> None:
    """`--out` must be a folder or a path a folder can be made at, and writable: checked with
    os.access and a probe file that is never linked into the folder. Nothing is created."""
    path = existing = Path(out)
    while True:  # the nearest part of the path that exists ('.' or '/' at the latest)
        try:
            mode = os.stat(existing).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            if existing == existing.parent:
                raise UserError(f"--out {out!r} has no existing folder above it: give a directory for the run") from None
            existing = existing.parent
        except (OSError, ValueError) as e:
            raise UserError(f"--out {out!r} cannot be used: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISDIR(mode):
        where = "is a file" if existing == path else f"is under {str(existing)!r}, which is a file"
        raise UserError(f"--out {out!r} {where}: give a directory for the run")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out!r} is not writable ({str(existing)!r}: permission denied): give a writable directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UserError(f"--out {out!r} is not writable ({str(existing)!r}: {e.strerror}): give a writable directory") from None
    if existing == path:
        _check_run_files(path)


def _check_run_files(run_dir: Path) -> None:
    """In an existing run directory, what the run writes must have its kind: a folder for checkpoints,
    regular files for the rest."""
    for name, kind in RUN_FILES.items():
        try:
            mode = os.stat(run_dir / name).st_mode
        except FileNotFoundError:
            continue
        if not (stat.S_ISDIR(mode) if kind == "folder" else stat.S_ISREG(mode)):
            raise UserError(
                f"--out {str(run_dir)!r} holds {name!r} that is not a {kind}: move it away or use another --out"
            )
