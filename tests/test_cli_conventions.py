"""CLI conventions: --version, defaults and allowed values in every --help, the everyday train flags,
one spelling of model names, booleans and schedules across train/plan/bench, the preset override warning.

All in-process through `ndtrain.cli.commands.main` with `--help`, `--check` and `plan` (no training)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ndtrain
from ndtrain import version
from ndtrain.cli import commands as cli
from ndtrain.cli import flags as cli_flags
from ndtrain.bench import cli as bench_cli
from ndtrain.config import options
from ndtrain.config import MODEL_PRESETS, PRESET_NAMES, allowed_values
from ndtrain.config.options import PP_SCHEDULES, ZERO_STAGES
from ndtrain.plan import cli as plan_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def exit_status(argv: list[str]) -> int:
    """`ndtrain ARGV`'s exit status, whether main returns it or the parser exits with it."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one option's help on one line
    assert exit_status([*argv, "--help"]) == 0
    return capsys.readouterr().out


def option_blocks(text: str) -> dict[str, str]:
    """Each option of a --help text: its invocation (`--lr N`) → its whole entry."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def options_without_default(text: str) -> list[str]:
    """Options that take a value but whose help states no default (switches such as --check take none)."""
    missing = []
    for invocation, block in option_blocks(text).items():
        takes_value = any(not word.startswith("-") for word in invocation.replace(",", " ").split())
        if takes_value and "default: " not in block:
            missing.append(invocation)
    return missing


def check_toml(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """`ndtrain train --check ARGV`: exit 0 and the resolved config it prints."""
    assert exit_status(["train", "--check", *argv]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_version_flag_prints_ndtrain_and_torch_versions() -> None:
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"ndtrain {ndtrain.__version__} (torch {torch.__version__})\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", ndtrain.__version__)


def test_version_falls_back_to_pyproject_without_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = tomllib.loads(version.PYPROJECT.read_text())
    assert version.package_version() == pyproject["project"]["version"]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "ndtrain"\nversion = "9.8.7"\n')
    assert version.source_tree_version(tmp_path / "pyproject.toml") == "9.8.7"
    assert version.source_tree_version(tmp_path / "missing.toml") == "unknown"


@pytest.mark.parametrize("command", sorted(subcommands()))  # every command there is, not a list to keep up
def test_every_option_shows_its_default(command: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_text([command], capsys, monkeypatch)
    blocks = option_blocks(text)
    shown = [a for a in subcommands()[command]._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert len(blocks) == len(shown)  # every option parsed (bench's internal --memory-of is not shown)
    assert options_without_default(text) == []


def test_the_default_check_fails_for_a_flag_without_one() -> None:
    parser = cli.OneLineParser(prog="ndtrain demo")
    parser.add_argument("--documented", type=int, default=3, help="has one")
    parser.add_argument("--forgotten", type=int, help="has none")
    parser.add_argument("--switch", action="store_true", help="a switch takes no value")
    assert options_without_default(parser.format_help()) == ["--forgotten FORGOTTEN"]


def test_train_help_defaults_are_what_check_resolves(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocks = option_blocks(help_text(["train"], capsys, monkeypatch))
    resolved = check_toml(["--out", str(tmp_path / "run")], capsys)
    for flag, (key, _, _) in cli.TRAIN_FLAGS.items():
        if flag == "--out":
            continue  # given above
        (block,) = [b for invocation, b in blocks.items() if invocation.split()[0] == flag]
        shown = re.search(r"\(default: (.*)\)$", block).group(1)
        node = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None  # dump_toml leaves out None
        if isinstance(node, bool):
            value = "true" if node else "false"
        else:
            value = "none" if node in (None, "") else str(node)
        assert value in shown, (flag, shown, node)
        assert f"[{key}]" in block


def test_fine_tuning_data_flags_set_their_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n' * 64)
    resolved = check_toml(["--out", str(tmp_path / "run"), "--data", str(chat), "--global-batch", "8", "--micro-batch", "4", "--data-kind",
                           "chat", "--loss-on", "all", "--max-length", "100", "--overlong", "drop", "--packing",
                           "false"], capsys)
    assert {key: resolved["data"][key] for key in ("kind", "loss_on", "max_length", "overlong", "packing")} == \
        {"kind": "chat", "loss_on": "all", "max_length": 100, "overlong": "drop", "packing": False}


@pytest.mark.parametrize("flag, allowed", [
    ("--precision", "{fp32,bf16,fp16}"), ("--recompute", "{none,selective,full}"), ("--sp", "{true,false}"),
    ("--schedule", "{naive,gpipe,1f1b,interleaved,zb}"), ("--dp-mode", "{ddp,single-process}"),
    ("--ps.mode", "{sync,async,ssp}"), ("--zero", "{0,1,2,3}"),
    ("--model", "{tiny,small,bench,bench-25m,bench-100m,digits,hf:PATH}"),
])
def test_train_help_lists_allowed_values(flag: str, allowed: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert f"{flag} {allowed}" in option_blocks(help_text(["train"], capsys, monkeypatch))


def flag_choices(parser: argparse.ArgumentParser, flag: str) -> object:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action.choices


CLOSED_FLAGS = {"--precision": options.Precision, "--recompute": options.RecomputeMode,
                "--schedule": options.PipelineSchedule, "--dp-mode": options.DpMode, "--zero": options.ZeroStage,
                "--ps.mode": options.PsMode}


@pytest.mark.parametrize("flag", CLOSED_FLAGS)
def test_train_choices_are_the_literal_values(flag: str) -> None:
    """The option types of config/options.py are the one definition: the parser offers exactly their values."""
    assert flag_choices(subcommands()["train"], flag) == options.values(CLOSED_FLAGS[flag])


def test_every_closed_config_key_has_its_literal_as_choices() -> None:
    """Every train flag whose config key is annotated with a Literal offers its values; every other has no choices."""
    train = subcommands()["train"]
    for flag, (key, _, _) in cli.TRAIN_FLAGS.items():
        expected = None if key == "model.preset" else allowed_values(key)
        assert flag_choices(train, flag) == expected, flag


def test_readme_usage_lists_the_literal_values() -> None:
    """The README's `ndtrain train` usage block lists each closed flag's values as config/options.py defines them."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    usage = readme.split("## The `ndtrain` command", 1)[1].split("ndtrain generate", 1)[0]
    for flag, option in CLOSED_FLAGS.items():
        listed = re.search(re.escape(flag) + r" ([\w|-]+)", usage)
        assert listed is not None and listed.group(1) == "|".join(map(str, options.values(option))), flag


def test_choices_are_the_config_tuples() -> None:
    choices = flag_choices
    parsers = subcommands()
    for command in ("train", "plan"):
        assert choices(parsers[command], "--schedule") is PP_SCHEDULES
        assert choices(parsers[command], "--zero") is ZERO_STAGES
    assert choices(parsers["train"], "--precision") is options.values(options.Precision)
    (model,) = [a for a in parsers["train"]._actions if "--model" in a.option_strings]
    assert all(model.type(name) == name for name in PRESET_NAMES) and model.type("hf:some/dir") == "hf:some/dir"
    with pytest.raises(argparse.ArgumentTypeError):
        model.type("gpt9")
    assert tuple(choices(parsers["bench"], "--model")) == tuple(MODEL_PRESETS)
    assert tuple(choices(parsers["plan"], "--model"))[:len(MODEL_PRESETS)] == tuple(MODEL_PRESETS)


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["train", "--zero", "4"], "argument --zero: invalid choice: 4"),
    (["train", "--schedule", "1F1B"], "argument --schedule: invalid choice: '1F1B'"),
    (["train", "--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
    (["train", "--dp-mode", "threads"], "argument --dp-mode: invalid choice: 'threads'"),
    (["train", "--ps.mode", "eventual"], "argument --ps.mode: invalid choice: 'eventual'"),
    (["train", "--model", "huge"], "argument --model: invalid choice: 'huge'"),
    (["train", "--sp", "maybe"], "argument --sp: expected true or false, got 'maybe'"),
    (["train", "--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["plan", "--schedule", "pipedream"], "argument --schedule: invalid choice: 'pipedream'"),
    (["plan", "--sp", "maybe"], "argument --sp: expected true or false, got 'maybe'"),
    (["plan", "--gpu", "v100"], "argument --gpu: invalid choice: 'v100'"),
    (["bench", "ddp", "--model", "huge"], "argument --model: invalid choice: 'huge'"),
])
def test_values_outside_the_allowed_set_are_one_line_exit_2(argv: list[str], fragment: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ndtrain: error: ndtrain {argv[0]}: ") and fragment in err, err


def test_everyday_train_flags_set_their_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    resolved = check_toml(["--out", str(tmp_path / "run"), "--model", "tiny", "--lr", "1e-3", "--global-batch", "8",
                           "--micro-batch", "2", "--seq-len", "16", "--eval-every", "5", "--sp", "false",
                           "--schedule", "gpipe", "--nproc", "1"], capsys)
    assert resolved["optim"]["lr"] == 1e-3
    assert (resolved["schedule"]["global_batch"], resolved["schedule"]["micro_batch"]) == (8, 2)
    assert (resolved["model"]["preset"], resolved["model"]["seq_len"], resolved["model"]["dim"]) == ("tiny", 16, 32)
    assert resolved["log"]["eval_every"] == 5
    assert resolved["parallel"]["pp_schedule"] == "gpipe" and resolved["parallel"]["sequence_parallel"] is False


@pytest.mark.parametrize("word, value", [("true", True), ("True", True), ("on", True), ("false", False),
                                         ("OFF", False), ("0", False)])
def test_one_boolean_parser(word: str, value: bool) -> None:
    assert cli_flags.parse_bool(word) is value


def plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict]:
    assert exit_status(["plan", "--gpus", "2", "--gpu", "h100-sxm", "--global-batch", "8", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["candidates"]


def test_plan_takes_train_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    candidates = plan_json(["--model", "tiny", "--sp", "true", "--tp", "2"], capsys)
    assert candidates and all(c["layout"]["sp"] is True and c["layout"]["tp"] == 2 for c in candidates)
    assert plan_json(["--model", "ndtrain-tiny", "--sp", "on", "--tp", "2"], capsys) == candidates  # the old spelling
    assert plan_json(["--model", "tiny", "--sp", "false", "--tp", "2"], capsys)[0]["layout"]["sp"] is False
    assert plan_cli.model_name("tiny") == "tiny" and plan_cli.model_name("ndtrain-bench") == "bench"


LAYOUT = ["--model", "bench", "--pp", "2", "--tp", "1", "--dp", "1", "--cp", "1", "--zero", "0", "--micro-batch", "1",
          "--recompute", "none", "--sp", "false"]


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_plan_models_every_train_schedule(schedule: str, capsys: pytest.CaptureFixture[str]) -> None:
    vpp = ["--vpp", "2"] if schedule == "interleaved" else []
    (only,) = plan_json([*LAYOUT, "--schedule", schedule, *vpp], capsys)
    assert only["layout"]["schedule"] == schedule and only["fits"]


def test_plan_naive_schedule_idles_m_times_longer_than_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    """naive: one micro-batch in the pipeline at a time, m·(p−1)·(t_f+t_b) idle; 1F1B: (p−1)·(t_f+t_b)."""
    layout = ["--model", "gpt3-125m", *LAYOUT[2:]]  # times of milliseconds: well above the JSON's rounding
    (naive,) = plan_json([*layout, "--schedule", "naive"], capsys)
    (one_f_one_b,) = plan_json([*layout, "--schedule", "1f1b"], capsys)
    m = 8  # global batch 8 / (dp 1 × micro-batch 1)
    assert naive["time_s"]["bubble"] == pytest.approx(m * one_f_one_b["time_s"]["bubble"], rel=1e-3)
    assert naive["memory_gib"]["activations"] <= one_f_one_b["memory_gib"]["activations"]


def test_bench_model_flag_reaches_the_workers() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "pp", "--model", "tiny", "--micro-batch", "4", "--seq-len", "32"])
    assert (args.preset, args.micro_batch, args.seq_len) == ("tiny", 4, 32)
    again = parser.parse_args(["bench", *bench_cli._worker_argv(args)])
    assert vars(again) == vars(args)


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_config_sizes_over_a_preset_warn_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_config(tmp_path, "[model]\ndim = 64\nn_layers = 3\nseq_len = 64\nvocab_size = 256\n")
    assert exit_status(["train", config, "--model", "tiny", "--seq-len", "16", "--check", "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"ndtrain: warning: config file {config!r} sets model.dim, model.n_layers: its values "
                            f"replace those of --model tiny (preset, then file, then flags); remove them from the file "
                            f"to get the preset's sizes\n")
    model = tomllib.loads(captured.out)["model"]  # preset, then file, then flags
    assert (model["dim"], model["n_layers"], model["n_heads"], model["seq_len"]) == (64, 3, 4, 16)


@pytest.mark.parametrize("text, argv", [
    ("[model]\ndim = 64\n", []),                                 # no preset on the command line
    ("[model]\nvocab_size = 512\n[optim]\nlr = 1e-3\n", ["--model", "tiny"]),  # no size the preset sets
])
def test_no_warning_without_an_override(text: str, argv: list[str], capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    config = write_config(tmp_path, text)
    assert exit_status(["train", config, *argv, "--check", "--out", str(tmp_path / "r")]) == 0
    assert capsys.readouterr().err == ""


def test_workers_do_not_repeat_the_warning(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    config = write_config(tmp_path, "[model]\ndim = 64\n")
    args = cli.build_parser().parse_args(["train", config, "--model", "tiny"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.train_config(args).model.dim == 64
    assert capsys.readouterr().err == ""
