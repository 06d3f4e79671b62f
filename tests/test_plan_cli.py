"""`ndtrain plan` end to end through its argparse surface: output formats, exit codes, error lines."""

from __future__ import annotations

import json

import pytest

from ndtrain.cli.commands import OneLineParser
from ndtrain.plan import arch, cli
from tests.plan_profiles import bench_pieces, cpu_profile

LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "2", "--cp", "1", "--zero", "1", "--mbs", "1", "--vpp", "1",
          "--recompute", "selective", "--sp", "on", "--schedule", "1f1b"]


def run(argv: list[str]) -> int:
    """`ndtrain plan ARGV`'s exit status; a usage error (refused by the parser) is one line and status 2."""
    parser = OneLineParser(prog="ndtrain plan")
    cli.add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return cli.main(args)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: "), err
    return err


def test_json_candidates_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm", "--global-batch", "64",
                "--zero", "1", "--mbs", "1", "--json", "--top", "5"])
    assert code == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"]
    assert 1 <= len(candidates) <= 5
    speeds = [c["tokens_per_s"] for c in candidates]
    assert speeds == sorted(speeds, reverse=True) and all(c["fits"] for c in candidates)
    assert all(c["layout"]["tp"] * c["layout"]["pp"] * c["layout"]["dp"] * c["layout"]["cp"] == 16 for c in candidates)


def test_table_with_explain(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--model", "gpt3-1.3b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "32",
                "--mbs", "2", "--explain", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "gpt3-1.3b: 1.316 B parameters" in out and "tokens/s" in out
    assert "layouts considered" in out and "e.g." in out


def test_one_explicit_model_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["--arch", "gpt", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "51200",
                "--seq", "2048", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16", "--json", *LAYOUT])
    assert code == 0
    (only,) = json.loads(capsys.readouterr().out)["candidates"]
    assert only["layout"] == {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "zero": 1, "mbs": 1, "vpp": 1,
                              "recompute": "selective", "sp": True, "schedule": "1f1b"}


def test_nothing_fits_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--model", "llama3-405b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "8",
                "--mbs", "1", "--zero", "3"]) == 1
    captured = capsys.readouterr()
    assert "NO" in captured.out and "no layout fits" in captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16", "--tp", "3"],
     "--tp 3 does not divide --gpus 8"),
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16", "--tp", "8",
      "--pp", "1", "--dp", "1", "--cp", "1", "--zero", "0", "--mbs", "1", "--recompute", "none", "--sp", "on"],
     "tp=8 does not divide the 12 attention heads"),
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "9", *LAYOUT],
     "global batch 9 is not divisible by dp×mbs = 2×1"),
    (["--model", "gpt9", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16"], "argument --model: invalid choice: 'gpt9'"),
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "v100", "--global-batch", "16"], "argument --gpu: invalid choice: 'v100'"),
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "a100-80gb"], "--global-batch is required"),
    (["--arch", "gpt", "--layers", "2", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8"],
     "--arch gpt needs --hidden, --heads, --vocab, --seq"),
    (["--model", "gpt3-125m", "--gpus", "12", "--gpu", "a100-80gb", "--global-batch", "16"],
     "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["--model", "gpt3-125m", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16", "--sp", "maybe"],
     "argument --sp: expected true or false, got 'maybe'"),
    (["--model", "gpt3-125m", "--gpus", "8", "--profile", "/nonexistent/p.json", "--global-batch", "16"],
     "cannot read an ndtrain CPU profile"),
])
def test_user_errors_are_one_line_and_exit_2(argv: list[str], fragment: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    assert fragment in one_error_line(capsys)


def test_cpu_profile_plans_local_processes(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cpu_profile(pieces={arch.PRESETS["ndtrain-bench"]: bench_pieces()})))
    assert run(["--model", "ndtrain-bench", "--profile", str(path), "--gpus", "4", "--global-batch", "8",
                "--json", "--top", "20"]) == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"]
    assert len(candidates) == 20 and candidates[0]["step_time_s"] > 0
    assert all(c["mfu"] <= 1.0 for c in candidates)


@pytest.mark.parametrize("argv, fragment", [
    (["--calibrate", "--model", "gpt3-125m"], "profiles llama models"),
    (["--calibrate", "--gpus", "0"], "--gpus 0 must be > 0"),
])
def test_calibrate_mistakes_are_refused_before_measuring(argv: list[str], fragment: str, tmp_path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv + ["--out", str(tmp_path / "p.json")]) == 2
    assert fragment in one_error_line(capsys)
    assert not (tmp_path / "p.json").exists()


def test_an_old_profile_is_refused_with_the_fix(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**cpu_profile(), "version": 1}))
    assert run(["--model", "ndtrain-bench", "--profile", str(path), "--gpus", "4", "--global-batch", "8"]) == 2
    assert "is a version 1 profile; this planner reads version 4: run `ndtrain plan --calibrate` again" in \
        one_error_line(capsys)


def test_published_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--published"]) == 0
    out = capsys.readouterr().out
    assert "llm-foundry" in out and "Megatron-Bridge 25.11" in out and "fused-fp8" in out
    assert "fit sources, in sample: " in out and "held out: 5 rows, median |error|" in out
    assert "ordering, BigScience" in out


def test_kernels_chooses_the_stack_of_a_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64", "--json", "--tp", "1",
            "--pp", "1", "--dp", "8", "--cp", "1", "--zero", "3", "--mbs", "1", "--vpp", "1", "--recompute", "full",
            "--sp", "false"]
    speeds = {}
    for stack in ("eager", "fused", "fused-fp8"):
        assert run([*argv, "--kernels", stack]) == 0
        speeds[stack] = json.loads(capsys.readouterr().out)["candidates"][0]["tokens_per_s"]
    assert run(argv) == 0  # the default: ndtrain's own layers, eager
    assert json.loads(capsys.readouterr().out)["candidates"][0]["tokens_per_s"] == speeds["eager"]
    assert speeds["eager"] < speeds["fused"] < speeds["fused-fp8"]


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "64", "--kernels", "fused-fp8"],
     "--kernels fused-fp8 runs FP8 GEMMs, which a100-80gb has no tensor cores for"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64", "--kernels", "cudnn"],
     "argument --kernels: invalid choice: 'cudnn'"),
    (["--model", "bench", "--gpus", "2", "--profile", "p.json", "--global-batch", "8", "--kernels", "eager"],
     "a --profile runs ndtrain's own layers at the rates --calibrate measured: drop --kernels"),
])
def test_kernels_mistakes_are_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    assert fragment in one_error_line(capsys)


def test_explain_shows_the_best_layouts_terms(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64",
                "--explain"]) == 0
    out = capsys.readouterr().out
    for term in ("kernel profile eager", "gemm", "waves", "no wave quantization", "attention", "element-wise",
                 "move at η_ew", "recompute adds", "one layer backward", "gradients reduced at 2 bytes", "φ =",
                 "dp_comm", "step"):
        assert term in out
