"""ndtrain's version: the installed package's metadata, or pyproject.toml's when run from a source tree.

Read once at import (`ndtrain.__version__`); `ndtrain --version` prints it with torch's.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    """The installed distribution's version; from a checkout that was never installed, pyproject's."""
    try:
        return importlib.metadata.version("ndtrain")
    except importlib.metadata.PackageNotFoundError:
        return source_tree_version(PYPROJECT)


def source_tree_version(pyproject: Path) -> str:
    """`project.version` of the pyproject.toml beside the package ("unknown" when there is none)."""
    try:
        with open(pyproject, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
