"""Bad input, systematically: every malformed input ends in exactly one line `ndtrain: error: ...` and
exit status 2 — no traceback, no hang, nothing written.

The listed cases run the CLI in-process (`ndtrain.cli.commands.main`) up to the point where it would start
training (`train --check`); two run the real command without `--check` to show the launcher refuses
before any worker starts. The property-based tests (hypothesis, 200 derandomized examples each) feed
random config values, types and keys, TOML files, command lines and data files to the same entry
points. A FIFO is opened by nothing: a blocked open would trip the in-process alarm.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ndtrain.cli import commands as cli
from ndtrain.config import DataConfig, TrainConfig, read_toml
from ndtrain.run.config_checks import resolve_config
from ndtrain.data.corpus import load_corpus
from ndtrain.data.prepare import prepare_data
from ndtrain.errors import UserError
from ndtrain.run.directory import MARKER

HANG_S = 20  # generous: the inputs here are answered in milliseconds; a blocked open never returns
PROPERTY = settings(max_examples=200, deadline=timedelta(seconds=10), derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Hang(BaseException):
    """Raised by the alarm: not an OSError, so no `except OSError` in the code under test swallows it."""


@contextlib.contextmanager
def no_hang(seconds: int = HANG_S) -> Iterator[None]:
    def alarm(*_: Any) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`ndtrain ARGV` in this process: (exit status, stdout, stderr). Any exception escapes (a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with no_hang(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as e:  # argparse
            status = e.code if isinstance(e.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def assert_one_line_error(status: int, err: str, fragment: str = "") -> None:
    lines = err.splitlines()
    assert status == 2, (status, err)
    assert len(lines) == 1 and lines[0].startswith("ndtrain: error: "), err
    assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture()
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding one of each bad file, and a good small text file."""
    monkeypatch.chdir(tmp_path)
    make_files(tmp_path)
    return tmp_path


def make_files(root: Path) -> None:
    (root / "binary.toml").write_bytes(b"\x00\x01\xff\xfe binary")
    (root / "folder.toml").mkdir()
    (root / "invalid-utf8.toml").write_bytes(b'[optim]\nlr = "\xff"\n')
    (root / "nested.toml").write_text("[model.extra]\na = 1\n")
    (root / "unknown.toml").write_text("[nonsense]\na = 1\n")
    (root / "wrong-type.toml").write_text('[model]\ndim = "wide"\n')
    (root / "a-file").write_text("not a folder\n")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "empty.txt").write_bytes(b"")
    (root / "empty-folder").mkdir()
    (root / "binary-folder").mkdir()
    (root / "binary-folder" / "data").write_bytes(b"\xff\xfe" * 100)
    (root / "bad.jsonl").write_text('{"text": 5}\n')
    (root / "short.txt").write_text("too short\n")
    (root / "text.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    (root / "not-a-profile.json").write_text('{"kind": "something else"}\n')
    (root / "odd-run" / "metrics.jsonl").mkdir(parents=True)
    (root / "odd-run" / MARKER).write_text("{}\n")  # a run directory of ours with odd entries
    (root / "odd-run-2").mkdir()
    (root / "odd-run-2" / MARKER).write_text("{}\n")
    (root / "odd-run-2" / "checkpoints").write_text("a file where the checkpoints go\n")
    os.mkfifo(root / "fifo")


OUT = ["--out", "run"]
# (argv, a fragment of the one error line). Each of these gave a traceback, was silently accepted or
# blocked before this test existed (see the docstring of each group).
CASES = [
    # config files: binary, a folder, a FIFO, invalid UTF-8; wrong shapes and types
    (["train", "--check", "binary.toml"], "is not UTF-8 text"),
    (["train", "--check", "folder.toml"], "is not a regular file"),
    (["train", "--check", "fifo"], "is not a regular file"),
    (["train", "--check", "invalid-utf8.toml"], "is not UTF-8 text"),
    (["train", "--check", "missing.toml"], "does not exist"),
    (["train", "--check", "nested.toml"], "unknown config key 'model.extra'"),
    (["train", "--check", "unknown.toml"], "unknown config key 'nonsense'"),
    (["train", "--check", "wrong-type.toml"], "config key 'model.dim' must be int"),
    # --out: a file, under a file, empty, a name the OS cannot take
    (["train", "--check", "--out", "a-file"], "is a file"),
    (["train", "--check", "--out", "a-file/run"], "is under 'a-file', which is a file"),
    (["train", "--check", "--out", "a-file/deeper/run"], "is under 'a-file', which is a file"),
    (["train", "--check", "--out", ""], "log.out (--out) is empty"),
    (["train", "--check", "--set", 'log.out=""'], "log.out (--out) is empty"),
    (["train", "--check", "--out", "x" * 5000], "cannot be used"),
    (["train", "--check", "--out", "odd-run"], "holds 'metrics.jsonl' that is not a file"),
    (["train", "--check", "--out", "odd-run-2"], "holds 'checkpoints' that is not a folder"),
    # non-finite floats, everywhere
    (["train", "--check", *OUT, "--set", "optim.lr=nan"], "'optim.lr' must be a finite number, got nan"),
    (["train", "--check", *OUT, "--set", "optim.lr=inf"], "'optim.lr' must be a finite number, got inf"),
    (["train", "--check", *OUT, "--set", "parallel.bucket_mb=nan"], "'parallel.bucket_mb' must be a finite"),
    (["train", "--check", *OUT, "--set", "parallel.timeout_s=inf"], "'parallel.timeout_s' must be a finite"),
    (["train", "--check", *OUT, "--set", "optim.grad_clip=nan"], "'optim.grad_clip' must be a finite"),
    (["train", "--check", *OUT, "--set", "data.val_fraction=-inf"], "'data.val_fraction' must be a finite"),
    (["train", "--check", *OUT, "--ps.slow-worker", "1:inf"], "ps.slow_worker='1:inf'"),
    # sizes and types
    (["train", "--check", *OUT, "--set", "model.vocab_size=100"], "smaller than the byte tokenizer's 256"),
    (["train", "--check", *OUT, "--set", "model.dim=99999999999999999999"], "does not fit in 64 bits"),
    (["train", "--check", *OUT, "--set", "model.dim=1048576"], "more than this machine's"),
    (["train", "--check", *OUT, "--set", "parallel.timeout_s=1e300"], "parallel.timeout_s=1e+300 exceeds"),
    (["train", "--check", *OUT, "--dp-mode", "single-process", "--set", "parallel.flat_adamw=true"],
     "parallel.flat_adamw=true needs dp_mode=ddp"),
    (["train", "--check", *OUT, "--seed", "-1"], "seed must be in [0, 2**63)"),
    (["train", "--check", *OUT, "--set", "launch.threads=4294967296"], "launch.threads must be in"),
    (["train", "--check", *OUT, "--set", "model.preset=[1]"], "model.preset=[1] is unknown"),
    (["train", "--check", *OUT, "--set", "model.dim=[1, 2]"], "'model.dim' must be int"),
    (["train", "--check", *OUT, "--set", "seed.x=1"], "config key 'seed' must be int"),
    (["train", "--check", *OUT, "--steps", "many"], "argument --steps: invalid int value"),
    (["train", "--check", *OUT, "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["train", "--check", *OUT, "--nproc", "0"], "launch.nproc must be > 0"),
    (["train", "--check", *OUT, "--nproc", "100000"], "processes per core on this machine's"),
    (["train", "--check", *OUT, "--zero", "7"], "argument --zero: invalid choice: 7"),
    (["train", "--check", *OUT, "--bogus"], "unrecognized arguments: --bogus"),
    # data: a FIFO, a socket, a device, binary, empty, no text, too short
    (["train", "--check", *OUT, "--data", "fifo"], "is a FIFO, not a regular file"),
    (["train", "--check", *OUT, "--data", "/dev/zero"], "is a character device, not a regular file"),
    (["train", "--check", *OUT, "--data", "binary.txt"], "is not UTF-8 text"),
    (["train", "--check", *OUT, "--data", "empty.txt"], "holds no text"),
    (["train", "--check", *OUT, "--data", "empty-folder"], "holds no text"),
    (["train", "--check", *OUT, "--data", "binary-folder"], "holds no text"),
    (["train", "--check", *OUT, "--data", "bad.jsonl"], 'has no string "text" field'),
    (["train", "--check", *OUT, "--data", "short.txt"], "too few for one window"),
    (["train", "--check", *OUT, "--data", ""], "data.path is empty"),
    # generate: checked before the run directory is read
    (["generate", "run", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["generate", "run", "--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["generate", "run", "--top-k", "-5"], "--top-k must be >= 0"),
    (["generate", "run", "--seed", "-1"], "--seed must be in [0, 2**63)"),
    # plan: sizes, and input files that are binary, folders, FIFOs or not what they claim
    (["plan", "--arch", "gpt", "--layers", "0", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq", "32",
      "--gpus", "1", "--gpu", "h100-sxm", "--global-batch", "8"], "--layers 0 must be > 0"),
    (["plan", "--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "0", "--vocab", "100",
      "--seq", "32", "--gpus", "1", "--gpu", "h100-sxm", "--global-batch", "8"], "--kv-heads 0 must be > 0"),
    (["plan", "--model", "llama3-8b", "--gpus", "4", "--profile", "binary.txt", "--global-batch", "8"], "cannot read"),
    (["plan", "--model", "llama3-8b", "--gpus", "4", "--profile", "folder.toml", "--global-batch", "8"],
     "is not a regular file"),
    (["plan", "--model", "llama3-8b", "--gpus", "4", "--profile", "fifo", "--global-batch", "8"], "is not a regular file"),
    (["plan", "--model", "llama3-8b", "--gpus", "4", "--profile", "not-a-profile.json", "--global-batch", "8"],
     "is not an ndtrain CPU profile"),
    (["plan", "--validate", "fifo", "--profile", "not-a-profile.json"], "is not a regular file"),
]


@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(files: Path, argv: list[str], fragment: str) -> None:
    before = sorted(p.name for p in files.iterdir())
    status, _, err = run_cli(argv)
    assert_one_line_error(status, err, fragment)
    assert sorted(p.name for p in files.iterdir()) == before  # nothing written


def test_cuda_without_a_gpu_is_refused_before_launch(files: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs one without")
    status, _, err = run_cli(["train", "--check", *OUT, "--set", "parallel.device=cuda"])
    assert_one_line_error(status, err, "no CUDA device is visible")


@pytest.mark.skipif(not os.access("/sys", os.F_OK), reason="no /sys: no read-only directory that binds root too")
def test_out_in_a_read_only_directory_is_refused(files: Path) -> None:
    """Permissions do not stop root; sysfs does. The probe file, not os.access alone, finds it."""
    status, _, err = run_cli(["train", "--check", "--out", "/sys/ndtrain-run"])
    assert_one_line_error(status, err, "--out '/sys/ndtrain-run' is not writable")


def test_a_socket_as_data_is_refused(files: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("sock")
        status, _, err = run_cli(["train", "--check", *OUT, "--data", "sock"])
    assert_one_line_error(status, err, "is a socket, not a regular file")


def test_check_prints_the_resolved_config_and_writes_nothing(files: Path) -> None:
    status, out, err = run_cli(["train", "--check", "--model", "tiny", "--out", "run", "--data", "text.txt",
                                "--set", "optim.skip_nonfinite=true"])
    assert (status, err) == (0, "")
    import tomllib

    resolved = tomllib.loads(out)
    assert resolved["model"]["dim"] == 32 and resolved["optim"]["skip_nonfinite"] is True
    assert resolved["data"]["path"] == "text.txt" and resolved["log"]["out"] == "run"
    assert not (files / "run").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["binary.toml"], "is not UTF-8 text"),
    (["--out", "a-file/run", "--data", "fifo"], "is under 'a-file', which is a file"),
    (["--out", "run", "--data", "fifo"], "is a FIFO"),
])
def test_the_command_refuses_before_starting_workers(files: Path, argv: list[str], fragment: str) -> None:
    """The real command without --check: the launcher answers (no worker output, no run directory)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "ndtrain", "train", *argv], capture_output=True, text=True,
                         timeout=120, env=env, cwd=files)
    assert_one_line_error(run.returncode, run.stderr, fragment)
    assert run.stdout == "" and not (files / "run").exists()


# ------------------------------------------------------------------------------------ properties
KNOWN_KEYS = sorted(
    f"{section}.{key}" if isinstance(value, dict) else section
    for section, table in TrainConfig().to_dict().items()
    for key, value in (table.items() if isinstance(table, dict) else [(section, table)])
)
SAFE_TEXT = st.text(max_size=12).filter(lambda s: "/" not in s and s not in (".", "..") and "\x00" not in s)
SCALARS = st.one_of(
    st.booleans(), st.integers(), st.integers(min_value=-2, max_value=70), st.floats(allow_nan=True, allow_infinity=True),
    SAFE_TEXT, st.sampled_from(["fp32", "bf16", "fp16", "tiny", "1:2", "ddp", "interleaved", "layers.*", "cuda"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SAFE_TEXT, inner, max_size=3),
                      max_leaves=6)
KEYS = st.one_of(st.sampled_from(KNOWN_KEYS), st.sampled_from(["model", "optim", "nonsense", "model.nonsense"]),
                 SAFE_TEXT.map(lambda s: s or "x"))


def toml_value(value: Any) -> str:
    """A TOML rendering of a generated value (strings as JSON-escaped basic strings, tables inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty working directory (random relative names find nothing but the files made here)."""
    root = tmp_path_factory.mktemp("hostile")
    make_files(root)
    cwd = os.getcwd()
    os.chdir(root)
    yield root
    os.chdir(cwd)


def valid_or_one_line(argv: list[str]) -> None:
    status, out, err = run_cli(argv)
    if status == 0:
        assert err == "" and "[model]" in out, (argv, err)
    else:
        assert_one_line_error(status, err)


@PROPERTY
@given(st.dictionaries(KEYS, VALUES, max_size=4))
def test_config_loader_gives_a_config_or_a_user_error(workdir: Path, overrides: dict[str, Any]) -> None:
    try:
        cfg = resolve_config(None, overrides)
    except UserError as e:
        assert "\n" not in str(e) and str(e)
    else:
        assert isinstance(cfg, TrainConfig)


@PROPERTY
@given(st.lists(st.tuples(KEYS, VALUES), max_size=4))
def test_set_overrides_give_a_config_or_one_line(workdir: Path, items: list[tuple[str, Any]]) -> None:
    argv = ["train", "--check", "--out", "run"]
    for key, value in items:
        argv += ["--set", f"{key}={toml_value(value)}"]
    valid_or_one_line(argv)


@PROPERTY
@given(st.dictionaries(st.sampled_from(["model", "optim", "parallel", "data", "log", "nonsense"]),
                       st.dictionaries(KEYS, VALUES, max_size=3), max_size=3),
       st.dictionaries(KEYS, VALUES, max_size=2), st.binary(max_size=40), st.booleans())
def test_toml_files_give_a_config_or_one_line(
    workdir: Path, tables: dict[str, dict[str, Any]], top: dict[str, Any], junk: bytes, corrupt: bool,
) -> None:
    text = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in top.items())
    text += "".join(f"[{name}]\n" + "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in table.items())
                    for name, table in tables.items())
    data = text.encode("utf-8") + (junk if corrupt else b"")
    (workdir / "random.toml").write_bytes(data)
    valid_or_one_line(["train", "--check", "random.toml", "--out", "run"])


FLAG_VALUES = st.one_of(SAFE_TEXT, st.integers().map(str), st.floats().map(str),
                        st.sampled_from(["0", "-1", "1", "2", "4", "3", "nan", "inf", "true", "x", "", "a-file", "fifo",
                                         "binary.txt", "empty-folder", "text.txt", "a-file/run"]))


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from(sorted(cli.TRAIN_FLAGS) + ["--resume", "--bogus", "--set"]), FLAG_VALUES),
                max_size=5))
def test_train_flags_give_a_config_or_one_line(workdir: Path, flags: list[tuple[str, str]]) -> None:
    argv = ["train", "--check", "--out", "run"]
    for flag, value in flags:
        argv += [flag] if flag == "--resume" else [flag, value]
    valid_or_one_line(argv)


@PROPERTY
@given(st.binary(max_size=300), st.sampled_from(["data.txt", "data.jsonl", "folder/data"]))
def test_random_data_files_load_or_give_a_user_error(workdir: Path, data: bytes, name: str) -> None:
    path = workdir / "random-data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    target = path.parent if name.startswith("folder") else path
    with no_hang():
        try:
            prepare_data(DataConfig(path=str(target), val_fraction=0.5), 4, workdir / "run")
        except UserError as e:
            assert "\n" not in str(e)
    path.unlink()


def test_a_fifo_inside_a_data_folder_is_skipped_not_opened(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("hello world, " * 20)
    os.mkfifo(tmp_path / "pipe")
    with no_hang():
        corpus = load_corpus(str(tmp_path), 0.5)
    assert "(1 files, 0 skipped" in corpus.description, corpus.description


def test_toml_reader_refuses_a_fifo_without_opening_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.toml")
    with no_hang(), pytest.raises(UserError, match="is not a regular file"):
        read_toml(tmp_path / "config.toml")
