"""`ndtrain bench` at larger sizes and worlds: the bench presets up to ≈100 M parameters, the --nproc
and --device limits (one line each, before any worker starts), and a 1-step smoke through the CLI
on 2 ranks (the tiny model; bench-25m, the smallest new preset, as a slow test). No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndtrain.cli import commands as cli
from ndtrain.bench import cli as bench_cli
from ndtrain.config import MODEL_PRESETS, ModelConfig
from ndtrain.errors import UserError
from ndtrain.plan import arch
from tests.helpers.runs import ndtrain

# preset -> parameters by the model's formula (ModelConfig.parameter_count; test_model checks it on the built model)
SIZES = {"bench": 12_786_048, "bench-25m": 25_436_672, "bench-100m": 101_081_856}


@pytest.mark.parametrize("name", SIZES)
def test_bench_presets_have_their_stated_sizes_and_fit_bench_layouts(name: str) -> None:
    cfg = ModelConfig(**{"preset": name, **MODEL_PRESETS[name]})
    assert cfg.parameter_count() == SIZES[name]
    assert cfg.n_heads % 2 == 0 and cfg.n_kv_heads % 2 == 0  # bench layouts has tp = 2 layouts
    assert cfg.n_layers >= 8  # bench pp up to 8 ranks (a layer per stage); tp2 × pp2 × vpp2
    spec = arch.preset(f"ndtrain-{name}")  # the planner knows it (plan --validate reads the preset)
    assert spec.total_params == SIZES[name]


def test_the_bench_parser_takes_the_new_presets_and_the_device() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "zero3", "--model", "bench-100m", "--nproc", "8", "--device", "cpu"])
    assert (args.preset, args.nproc, args.device) == ("bench-100m", 8, "cpu")
    assert parser.parse_args(["bench", "ddp"]).device == "auto"
    assert vars(parser.parse_args(["bench", *bench_cli._worker_argv(args)])) == vars(args)


@pytest.mark.parametrize("nproc, device, gpus, message", [
    (0, "auto", 0, "bench --nproc 0 is not supported: give 1 to 8 local workers"),
    (9, "cpu", 0, "bench --nproc 9 is not supported: give 1 to 8 local workers"),
    (2, "cuda", 0, "bench --device cuda but no CUDA device is visible: use --device cpu (or auto)"),
    (4, "auto", 2, "bench --nproc 4 needs one GPU per worker, 2 visible: give --nproc <= 2 or --device cpu"),
    (3, "cuda", 2, "bench --nproc 3 needs one GPU per worker, 2 visible"),
])
def test_worlds_beyond_what_is_supported_are_one_line(nproc: int, device: str, gpus: int, message: str) -> None:
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        bench_cli.check_world(nproc, device, gpus)


@pytest.mark.parametrize("nproc, device, gpus", [(1, "auto", 0), (8, "auto", 0), (8, "cpu", 2), (2, "cuda", 2),
                                                  (8, "auto", 8)])
def test_supported_worlds_pass(nproc: int, device: str, gpus: int) -> None:
    bench_cli.check_world(nproc, device, gpus)


def test_too_many_workers_is_refused_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):  # the parent's path, not a worker's
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "r.json"
    assert cli.main(["bench", "ddp", "--nproc", "9", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "ndtrain: error: bench --nproc 9 is not supported: give 1 to 8 local workers\n"
    assert not out.exists()


# both `slow`: the bench CLI's launch is in CI through tests/test_bench.py and tests/test_bench_workers.py
@pytest.mark.parametrize("preset", [pytest.param("tiny", marks=pytest.mark.slow), pytest.param("bench-25m", marks=pytest.mark.slow)])
def test_one_step_of_ddp_through_the_cli(tmp_path: Path, preset: str) -> None:
    """The whole path: parent checks, launch, workers on --device cpu, the JSON with its device, and the
    parameter count in the printed table and the facts."""
    out = tmp_path / "ddp-n2.json"
    proc = ndtrain("bench", "ddp", "--nproc", "2", "--device", "cpu", "--model", preset, "--steps", "1",
                   "--warmup", "0", "--repeats", "1", "--seq-len", "16", "--micro-batch", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["world_size"], data["device"], data["options"]["preset"]) == (2, "cpu", preset)
    params = ModelConfig(**{"preset": preset, **MODEL_PRESETS[preset]}).parameter_count()
    facts = data["facts"]
    assert facts["parameters"] == params and facts["gradient_bytes"] == 4 * params
    assert [r["comm_bytes_per_step"] for r in data["runs"]["ours"]] == [float(facts["ring_bytes"])]
    assert f"parameters={params:,} ({params / 1e6:.1f} M)" in proc.stdout.splitlines()[0]
