"""The embedded default run reaches its promised validation loss (slow: a few minutes on 2 cores)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_run_learns_python(tmp_path: Path) -> None:
    out = tmp_path / "default"
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--out", str(out), "--set", "log.progress=false"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] <= 2.0 < math.log(256)
    assert summary["world_size"] == 2
    gen = subprocess.run([sys.executable, "-m", "ndtrain", "generate", str(out), "--prompt", "def "],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0 and gen.stdout.startswith("def ")
