"""`make gpu-check` without a GPU: one line, exit status 0 (the GPU run itself is docs/gpu.md's)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: make gpu-check measures it")


def test_gpu_check_without_a_gpu_is_one_line_and_exit_0() -> None:
    done = subprocess.run([sys.executable, "-m", "ndtrain.bench.gpu_check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: no CUDA device"), done.stdout
    assert not done.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_without_a_gpu_is_one_line_and_exit_0() -> None:
    done = subprocess.run(["make", "--no-print-directory", "gpu-check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: "), done.stdout
