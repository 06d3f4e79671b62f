"""Checkpoint manifests: what a complete checkpoint holds, how to verify it, which one to use.

`manifest.json` is the last file written into `step_XXXXXXXX.partial` (by rank 0, after every
rank has finished writing): each file's relative path, size and SHA-256, the step, the layout
(dp/cp/pp/tp sizes, ZeRO stage) and the ndtrain and torch versions. A checkpoint *verifies* when
its manifest reads and every listed file exists with that size and hash (files not listed are
ignored: loading reads only listed names). The manifest guards against damage (truncation,
flipped bytes, lost files), not against an attacker, who can rewrite it: `safe_pickle` does that.

Cost: rank 0 reads every byte of the checkpoint once to write the manifest (Ψ·12 bytes for fp32
AdamW, at SHA-256 speed: 564 MB/s measured on one shared CPU core) and once more per checkpoint
it verifies: the one chosen at resume (plus any damaged newer ones) and, at each save, the older
ones rotation inspects until `keep` verified ones are found (keep − 1 in a healthy directory).
Other ranks wait at the save's final barrier. Every listing of checkpoints (`step_dirs`: resume,
rotation, generate, export, the launcher's --resume check) refuses a tree holding a symbolic link.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Iterator

import torch

from ndtrain.errors import UserError

MANIFEST = "manifest.json"
STEP_PREFIX = "step_"
PARTIAL = ".partial"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _ndtrain_version() -> str:
    try:
        return package_metadata.version("ndtrain")
    except package_metadata.PackageNotFoundError:
        return "unknown"


def write_manifest(path: Path, step: int, layout: dict[str, int]) -> None:
    """Hash every file under `path` and write `path/manifest.json` (atomically, last)."""
    files = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        if relative != MANIFEST:
            files[relative] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    manifest = {"format": 1, "step": step, "layout": layout,
                "versions": {"ndtrain": _ndtrain_version(), "torch": torch.__version__}, "files": files}
    tmp = path / (MANIFEST + PARTIAL)
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path / MANIFEST)


def verify(path: Path) -> str | None:
    """None when the checkpoint at `path` verifies, else what is wrong with it (one phrase)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return "missing manifest.json"
    try:
        files = json.loads(manifest_file.read_text())["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest.json ({type(e).__name__})"
    for name, size, digest in entries:
        file = path / name
        if not file.is_file():
            return f"missing file {name}"
        actual = file.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, the manifest says {size}"
        if sha256_file(file) != digest:
            return f"file {name} does not match its SHA-256 in the manifest"
    return None


def step_of(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX):])


def refuse_links(directory: Path) -> None:
    """A UserError naming the first symbolic link in the checkpoint tree `directory` (itself included).

    Every checkpoint of a run lives inside its run directory: a link would be followed when loading
    (another run's state, or a file that is no checkpoint) and deleted through by rotation, so none
    is used. Cost: one `lstat` per entry (a checkpoint holds a few files per rank)."""
    if directory.is_symlink():
        link = directory
    else:
        link = next((p for p in _entries(directory) if p.is_symlink()), None) if directory.is_dir() else None
    if link is not None:
        raise UserError(f"{str(link)!r} is a symbolic link (to {os.readlink(link)!r}): checkpoints must lie inside the "
                        "run directory, and ndtrain neither follows nor deletes links there; replace the link with "
                        "the directory it names (or remove it)")


def _entries(directory: Path) -> Iterator[Path]:
    """Every entry under `directory`, links reported but never entered."""
    for entry in os.scandir(directory):
        yield Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            yield from _entries(Path(entry.path))


def step_dirs(directory: Path) -> list[Path]:
    """Finished (renamed) checkpoint directories, newest first; `.partial` ones are not among them.
    A tree holding a symbolic link is refused (`refuse_links`)."""
    refuse_links(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir()
             if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=step_of, reverse=True)


@dataclass
class Choice:
    """The checkpoint to load (None: no verified one) and every newer one that failed, with why."""

    path: Path | None
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    candidates: list[Path] = field(default_factory=list)

    def report(self) -> list[str]:
        """One line per damaged checkpoint."""
        use = f"; using {self.path.name}" if self.path else ""
        return [f"checkpoint {str(p)!r} is damaged ({why}), skipped{use}" for p, why in self.damaged]


def choose(directory: Path) -> Choice:
    """The newest verified checkpoint of `directory`, scanning newest first.

    `latest` names the newest checkpoint after each save, so in a healthy directory this is the
    one `latest` names; when `latest` is missing, stale or names a damaged checkpoint, the scan
    still finds the newest that verifies.
    """
    candidates = step_dirs(directory)
    damaged = []
    for path in candidates:
        problem = verify(path)
        if problem is None:
            return Choice(path, damaged, candidates)
        damaged.append((path, problem))
    return Choice(None, damaged, candidates)


def obsolete(directory: Path, keep: int, verified: Path) -> list[Path]:
    """Checkpoints rotation may delete: those older than the `keep`-th newest verified one.

    `verified` (the checkpoint just written and verified) counts without re-hashing. Damaged or
    unverified checkpoints newer than that point are left in place and never count as kept, so
    the newest verified checkpoint is never among the returned ones.
    """
    kept = 0
    dirs = step_dirs(directory)
    for index, path in enumerate(dirs):
        if path == verified or verify(path) is None:
            kept += 1
            if kept == keep:
                return dirs[index + 1:]
    return []
