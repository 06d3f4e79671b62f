"""Config loading and the command line's handling of bad input: one line, exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.cli.commands import main
from ndtrain.config import dump_toml, load_config, parse_override
from ndtrain.errors import UserError


def test_toml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[model]\npreset = "tiny"\ndim = 64\n[optim]\nlr = 1e-3\n')
    cfg = load_config(path, {"optim.lr": 5e-4, "schedule.steps": 7})
    assert (cfg.seed, cfg.model.dim, cfg.model.n_layers, cfg.optim.lr, cfg.schedule.steps) == (3, 64, 2, 5e-4, 7)


def test_dump_toml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, {"model.preset": "tiny", "data.path": str(tmp_path), "log.out": 'a "quoted" dir'})
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg


def test_set_values_are_typed() -> None:
    assert parse_override("optim.lr=3e-4") == ("optim.lr", 3e-4)
    assert parse_override("log.progress=false") == ("log.progress", False)
    assert parse_override("log.out=runs/x") == ("log.out", "runs/x")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim.lrr": 1.0}, "unknown config key 'optim.lrr'"),
        ({"bogus": 1}, "unknown config key 'bogus' at top level"),
        ({"optim.lr": "fast"}, "config key 'optim.lr' must be float, got 'fast'"),
        ({"schedule.steps": 1.5}, "config key 'schedule.steps' must be int"),
        ({"optim.lr": -1.0}, "optim.lr must be > 0, got -1.0"),
        ({"model.preset": "huge"}, "model.preset='huge' is unknown"),
        ({"model.n_heads": 3}, "model.dim=256 is not divisible by model.n_heads=3"),
        ({"parallel.zero": 5}, "parallel.zero must be 0, 1, 2 or 3, got 5"),
        ({"parallel.backend": "tcp"}, "parallel.backend='tcp' is not one of auto, gloo, nccl, mpi"),
        ({"data.path": "/no/such/corpus"}, "data.path '/no/such/corpus' does not exist"),
    ],
)
def test_bad_config_is_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, overrides)


def test_bad_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[model\n")
    with pytest.raises(UserError, match="is not valid TOML"):
        load_config(path)
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--nproc", "3", "--dp", "2"], "dp=2 × cp=1 × pp=1 × tp=1 does not equal the world size 3"),
        (["train", "--nproc", "2", "--set", "schedule.global_batch=6", "--set", "schedule.micro_batch=4"],
         "schedule.global_batch=6 is not divisible by dp=2 × schedule.micro_batch=4"),
        (["train", "--set", "parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3, got 4"),
        (["train", "--precision", "fp16", "--set", "parallel.loss_scaling=false"],
         "parallel.precision=fp16 needs loss scaling"),
        (["train", "--set", "parallel.precision=fp8"], "parallel.precision='fp8' is not one of fp32, bf16, fp16"),
        (["train", "--vpp", "2"], "parallel.pp_virtual=2 needs parallel.pp_schedule=interleaved"),
        (["train", "--set", "parallel.fsdp_wrap= , "], "parallel.fsdp_wrap is empty"),
        (["train", "--set", "ps.mode=eventual"], "ps.mode='eventual' is not one of sync, async, ssp"),
        (["train", "--ps.staleness", "-1"], "ps.staleness must be >= 0, got -1"),
        (["train", "--set", "optim"], "--set expects key=value"),
        (["generate", "/no/such/run"], "is not an ndtrain run directory"),
    ],
)
def test_cli_user_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ndtrain: error: ") and message in err
    assert "\n" not in err


def test_cli_error_has_no_traceback_and_exit_status_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ndtrain", "train", "--set", "optim.lr=-3"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ndtrain: error: optim.lr must be > 0, got -3.0"
    assert "Traceback" not in proc.stderr
