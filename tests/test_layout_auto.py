"""`ndtrain train --layout auto`: the planner's first-ranked layout, explicit layout keys fixed, applied to
the run's config before the workers start, predicted against measured at the end; refusals in one line.

Synthetic CPU profiles (tests/plan_profiles.py) written to tmp_path: no calibration here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ndtrain.cli import commands as cli
from ndtrain.cli import layout_auto
from ndtrain.errors import UserError
from ndtrain.plan import auto
from ndtrain.plan.cpu_profile import load_profile
from ndtrain.plan.hardware import Cluster, gpu_for_device
from ndtrain.plan.search import Fixed, search
from ndtrain.run.config_checks import resolve_config
from tests.helpers.runs import TINY_ARGS, corpus_file, ndtrain
from tests.plan_profiles import cpu_profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

TINY = {"model.preset": "tiny", "schedule.global_batch": 8, "launch.nproc": 2}


def write_profile(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "plan-profile.json"
    path.write_text(json.dumps({**cpu_profile(), **changes}))
    return path


def test_the_choice_is_what_search_ranks_first_and_keeps_a_fixed_axis(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    cfg = resolve_config(None, TINY)
    hardware = load_profile(profile, 2)
    ranked = search(auto.model_spec(cfg), Cluster(hardware, 2, 2), 8, Fixed()).candidates
    free = auto.choose(cfg, 2, Fixed(), hardware, "test", profile)
    assert free.layout == ranked[0].layout and free.feasible == len(ranked)
    assert free.step_s == ranked[0].timing.step and free.memory_bytes == ranked[0].memory.total
    assert free.layout.tp == 1  # so the fixed axis below changes the choice
    given = layout_auto.given_layout_keys(None, {**TINY, "parallel.tp": 2, "parallel.dp": 0})
    assert given == {"parallel.tp": 2, "parallel.dp": 0} and auto.fixed_axes(given) == Fixed(tp=2)
    tp2 = auto.choose(cfg, 2, auto.fixed_axes(given), hardware, "test", profile)
    assert tp2.layout == search(auto.model_spec(cfg), Cluster(hardware, 2, 2), 8, Fixed(tp=2)).candidates[0].layout
    assert tp2.layout.tp == 2 and tp2.layout.dp == 1
    applied = auto.apply(cfg, auto.layout_overrides(tp2.layout))
    assert (applied.parallel.tp, applied.parallel.dp, applied.parallel.layout) == (2, 1, "manual")
    assert applied.schedule.micro_batch == tp2.layout.mbs and applied.parallel.sequence_parallel == tp2.layout.sp


def test_adafactor_is_planned_without_zero_or_tp(tmp_path: Path) -> None:
    """Adafactor's factored moments need whole matrices (ZeRO and tp are refused for it): the choice keeps
    zero 0 and tp 1, and the run's config then validates."""
    profile = write_profile(tmp_path)
    hardware = load_profile(profile, 2)
    cfg = resolve_config(None, {**TINY, "parallel.tp": 2})
    assert auto.choose(cfg, 2, Fixed(tp=2), hardware, "test", profile).layout.tp == 2  # AdamW: tp as given
    cfg = resolve_config(None, {**TINY, "optim.name": "adafactor"})
    assert auto.optimizer_limits(cfg, Fixed(pp=2)) == Fixed(pp=2, zero=0, tp=1)
    choice = auto.choose(cfg, 2, Fixed(), hardware, "test", profile)
    assert (choice.layout.zero, choice.layout.tp) == (0, 1)
    applied = auto.apply(cfg, auto.layout_overrides(choice.layout))
    assert (applied.parallel.zero, applied.parallel.tp) == (0, 1)


def test_nothing_fits_is_one_line(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, memory_total_gib=0.5)  # 256 MiB per process, less than the 300 MiB baseline
    cfg = resolve_config(None, TINY)
    with pytest.raises(UserError, match="no layout fits in memory") as e:
        auto.choose(cfg, 2, Fixed(), load_profile(profile, 2), "test", profile)
    assert "\n" not in str(e.value)


def test_gpu_names() -> None:
    assert gpu_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm" and gpu_for_device("NVIDIA H200") == "h200"
    assert gpu_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb" and gpu_for_device("Tesla T4") is None


def test_train_layout_auto_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny = [*TINY_ARGS[:4], *TINY_ARGS[6:]]  # without schedule.micro_batch: searched
    proc = ndtrain("train", "--layout", "auto", "--profile", str(write_profile(tmp_path)), "--nproc", "2", "--steps",
                   "3", "--data", corpus_file(tmp_path), "--out", str(out), *tiny, "--set", "log.log_every=100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    (chosen,) = [line for line in lines if line.startswith("ndtrain: layout auto: tp")]
    (versus,) = [line for line in lines if line.startswith("ndtrain: layout auto: predicted")]
    record = json.loads((out / "layout-auto.json").read_text())
    layout = record["layout"]
    assert record["label"] in chosen and "layouts considered" in chosen and "MiB per rank" in chosen
    assert f"predicted step {record['predicted_step_s'] * 1e3:.1f} ms, measured " in versus
    assert "(median of steps after the first 1), error " in versus
    assert record["measured_step_s"] > 0 and record["profile"] == str((tmp_path / "plan-profile.json").resolve())
    # every step after the first, though only step 3 was logged (log.every 100, given last: it wins)
    assert record["measured_step_s"] == json.loads((out / "summary.json").read_text())["step_time_median_s"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [3]
    config = tomllib.loads((out / "config.toml").read_text())
    p = config["parallel"]
    assert p["layout"] == "manual" and config["schedule"]["micro_batch"] == layout["mbs"]
    axes = ("tp", "pp", "dp", "cp", "zero")
    assert tuple(p[k] for k in axes) == tuple(layout[k] for k in axes)
    assert (p["recompute"], p["sequence_parallel"], p["pp_virtual"]) == (layout["recompute"], layout["sp"], layout["vpp"])


def test_check_shows_the_choice_with_a_given_flag_fixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["train", "--layout", "auto", "--profile", str(write_profile(tmp_path)), "--tp", "2",
                       "--model", "tiny", "--global-batch", "8", "--out", str(tmp_path / "run"), "--check"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    resolved = tomllib.loads(captured.out)  # the TOML alone on stdout; the choice line on stderr
    assert resolved["parallel"]["tp"] == 2 and resolved["parallel"]["dp"] == 1
    assert resolved["parallel"]["layout"] == "manual"
    assert "ndtrain: layout auto: tp2 pp1 dp1" in captured.err
    assert not (tmp_path / "run").exists()


def error_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The stderr lines of `ndtrain ARGV`, asserting exit status 2."""
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = int(e.code or 0)
    assert status == 2
    return capsys.readouterr().err.splitlines()


def test_no_profile_is_one_line_naming_the_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = error_lines(["train", "--layout", "auto", "--profile", str(tmp_path / "none.json"), "--model", "tiny",
                           "--out", str(tmp_path / "run")], capsys)
    assert line.startswith("ndtrain: error: --layout auto on CPU plans with a calibrated profile")
    assert f"ndtrain plan --calibrate --model tiny --out {tmp_path / 'none.json'}" in line
    assert not (tmp_path / "run").exists()


def test_a_bad_layout_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = error_lines(["train", "--layout", "fastest"], capsys)
    assert "argument --layout: invalid choice: 'fastest'" in line
    (line,) = error_lines(["train", "--set", "parallel.layout=fastest"], capsys)
    assert "parallel.layout" in line and "manual" in line


def test_an_hf_model_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from tests.helpers.hf import hf_dir

    model = hf_dir(tmp_path, "llama")
    (line,) = error_lines(["train", "--layout", "auto", "--profile", str(write_profile(tmp_path)), "--model",
                           f"hf:{model}", "--out", str(tmp_path / "run")], capsys)
    assert line == ("ndtrain: error: --layout auto reads built-in presets only; pass the layout flags "
                    "(--tp/--pp/--dp/--cp/--zero)")


def test_workers_started_by_another_launcher_refuse_auto() -> None:
    cfg = resolve_config(None, {**TINY, "parallel.layout": "auto"})
    with pytest.raises(UserError, match="planned by ndtrain's own launcher, not in processes torchrun started"):
        layout_auto.refuse_outside_launcher(cfg, "torchrun")
    assert layout_auto.refuse_outside_launcher(resolve_config(None, TINY), "torchrun").parallel.layout == "manual"


def test_worker_argv_sets_the_choice_last(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    cfg = resolve_config(None, TINY)
    choice = auto.choose(cfg, 2, Fixed(), load_profile(profile, 2), "test", profile)
    argv = layout_auto.worker_argv(["train", "--layout", "auto", "--set", "parallel.tp=4"], choice)
    args = cli.build_parser().parse_args(argv)
    overrides = cli.train_overrides(args)
    assert overrides["parallel.layout"] == "manual" and overrides["parallel.tp"] == choice.layout.tp
    assert overrides["schedule.micro_batch"] == choice.layout.mbs
