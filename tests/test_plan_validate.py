"""The planner's local validation: Engine layouts mapped onto planner Layouts, `ndtrain plan --validate`
reading a `bench layouts` result (synthetic: no timing is measured or asserted here), and the tp and
sharded data-parallel (ZeRO-2 × tp, ZeRO-2/3 × pp) collectives the time model charges for our
implementation."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from ndtrain.bench.layouts import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH_SIZE, WORLD, layout_fields
from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.plan import arch, cli, collectives, validate
from ndtrain.plan.cpu_profile import load_profile
from ndtrain.plan.hardware import Cluster
from ndtrain.plan.layout import Layout, problem
from ndtrain.plan.memory import stage_params
from ndtrain.plan.timing import step_time
from tests.plan_profiles import bench_pieces, cpu_profile

PROFILE = cpu_profile()
BENCH = arch.preset("ndtrain-bench")


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ndtrain plan")
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


def test_layout_of_maps_the_engine_fields() -> None:
    fields = layout_fields(ParallelConfig(dp=1, tp=2, pp=2, pp_schedule="interleaved", pp_virtual=2))
    assert validate.layout_of(fields, 1) == Layout(
        tp=2, pp=2, dp=1, cp=1, zero=0, mbs=1, vpp=2, recompute="none", sp=False, schedule="interleaved")
    fields = layout_fields(ParallelConfig(dp=2, tp=2, zero=1, sequence_parallel=True, recompute="full"))
    assert validate.layout_of(fields, 4) == Layout(
        tp=2, pp=1, dp=2, cp=1, zero=1, mbs=4, vpp=1, recompute="full", sp=True, schedule="none")
    # pp = 1: the config's default schedule ("1f1b") means nothing, the planner's is "none"
    assert validate.layout_of(layout_fields(ParallelConfig(dp=4, zero=3)), 1).schedule == "none"


def test_every_bench_layout_is_a_distinct_layout_the_planner_models() -> None:
    layouts = [validate.layout_of(layout_fields(ParallelConfig(**f)), MICRO_BATCH_SIZE) for f in LAYOUTS.values()]
    assert len(set(layouts)) == len(layouts) >= validate.MIN_LAYOUTS
    for layout in layouts:
        assert problem(layout, BENCH, WORLD, GLOBAL_BATCH) is None, layout
        if layout.pp > 1:
            assert layout.micro_batches(GLOBAL_BATCH) >= 2 * layout.pp  # m ≥ 2p: the bubble is not everything


def bench_result(measured: dict[str, float], preset: str = "bench", seq_len: int = 256,
                 **changes: Any) -> dict[str, Any]:
    """A `bench layouts` JSON result as the harness writes it (the fields validate reads)."""
    layouts = {name: layout_fields(ParallelConfig(**LAYOUTS[name])) for name in measured}
    for name, change in changes.items():
        layouts[name].update(change)
    return {
        "scenario": "layouts", "world_size": WORLD, "device": "cpu", "reference": "dp4",
        "options": {"steps": 2, "warmup": 1, "repeats": 1, "seq_len": seq_len, "preset": preset},
        "facts": {"preset": preset, "global_batch": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH_SIZE,
                  "skipped": [], "layouts": layouts},
        "summary": {name: {"median_step_s": s, "ratio": 1.0} for name, s in measured.items()},
        "runs": {},
    }


def write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def predicted_by_planner(tmp_path: Path) -> dict[str, float]:
    cluster = Cluster(load_profile(write(tmp_path, "profile.json", PROFILE), WORLD), WORLD, WORLD)
    bench = validate.load_bench(write(tmp_path, "seed.json", bench_result({name: 1.0 for name in LAYOUTS})))
    return {name: timing.step for name, timing in validate.predictions(bench, cluster).items()}


def test_load_bench_reads_layouts_model_and_times(tmp_path: Path) -> None:
    bench = validate.load_bench(write(tmp_path, "r.json", bench_result({"dp4": 0.5, "pp4-gpipe": 0.75},
                                                                        preset="small", seq_len=64)))
    assert bench.model == arch.preset("ndtrain-small", 64)
    assert (bench.world, bench.global_batch) == (WORLD, GLOBAL_BATCH)
    assert bench.measured == {"dp4": 0.5, "pp4-gpipe": 0.75}
    assert bench.layouts["pp4-gpipe"] == Layout(4 // 4, 4, 1, 1, 0, 1, 1, "none", False, "gpipe")


def test_validate_prints_the_table_and_agreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    predicted = predicted_by_planner(tmp_path)
    # measured 10 % slower than predicted everywhere: the ranks agree, every error is 1/1.1 − 1
    result = write(tmp_path, "layouts-n4.json", bench_result({n: 1.1 * s for n, s in predicted.items()}))
    assert run(["--validate", str(result), "--profile", str(tmp_path / "profile.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(LAYOUTS) + 1
    for name, line in zip(LAYOUTS, lines[2:]):
        assert line.startswith(name) and line.endswith("-9.1%"), line
    assert lines[-1] == (f"Spearman ρ = 1.000, median |error| = 9.1 % over {len(LAYOUTS)} layouts; "
                         "acceptance (ρ ≥ 0.8, error ≤ 25 %, ≥ 8 layouts): met")


def test_validate_reports_a_miss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    predicted = predicted_by_planner(tmp_path)
    order = sorted(predicted, key=predicted.__getitem__)
    reversed_times = {name: predicted[partner] for name, partner in zip(order, reversed(order))}
    result = write(tmp_path, "layouts-n4.json", bench_result(reversed_times))
    assert run(["--validate", str(result), "--profile", str(tmp_path / "profile.json")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    rho = float(last.split()[3].rstrip(","))
    assert rho < -0.95 and last.endswith(": NOT met"), last  # not −1: ties (gpipe = 1f1b; pp4 at the shared-cores bound)
    # fewer than 8 layouts never meet the acceptance, however well they agree
    few = {name: predicted[name] for name in order[:3]}
    assert run(["--validate", str(write(tmp_path, "few.json", bench_result(few))),
                "--profile", str(tmp_path / "profile.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("over 3 layouts; acceptance (ρ ≥ 0.8, error ≤ 25 %, "
                                                             "≥ 8 layouts): NOT met")


@pytest.mark.parametrize("data, profile, message", [
    (bench_result({"dp4": 1.0, "dp4-zero1": 1.0}), False, "--validate needs --profile PATH"),
    ({"scenario": "ddp"}, True, "is not a `bench layouts` result"),
    (bench_result({"dp4": 1.0, "dp4-zero1": 1.0}, dp4={"precision": "bf16"}), True, "CPU profile models fp32 only"),
    ({**bench_result({"dp4": 1.0, "dp4-zero1": 1.0}), "device": "cuda"}, True,
     "the result was measured on cuda; the planner's local check compares with a CPU profile"),
    (bench_result({"dp4": 1.0, "pp4-gpipe": 1.0}, **{"pp4-gpipe": {"pp_schedule": "chimera"}}), True,
     "layout pp4-gpipe is not one the planner models: schedule='chimera'"),
])
def test_validate_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any],
                                        profile: bool, message: str) -> None:
    argv = ["--validate", str(write(tmp_path, "r.json", data))]
    if profile:
        argv += ["--profile", str(write(tmp_path, "profile.json", PROFILE))]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: ") and message in err, err


def test_load_bench_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read a `bench layouts` result"):
        validate.load_bench(tmp_path / "missing.json")


@pytest.mark.parametrize("sp", [False, True])
def test_tp_time_counts_every_collective_of_our_tp(tmp_path: Path, sp: bool) -> None:
    """Per micro-batch: 4 all-reduces of b·s·h per layer, the embedding's and the head input's (with
    SP each an all-gather + a reduce-scatter of the same bytes), the loss's two (b·s and 2·b·s fp32),
    and with SP on CPU one per norm gradient (2 per layer + 1); each at the profile's fit for its op
    in groups of 2 among 4 processes."""
    hw = load_profile(write(tmp_path, "profile.json", PROFILE), WORLD)
    assert hw.cpu is not None
    layout = Layout(tp=2, pp=1, dp=2, cp=1, zero=0, mbs=1, vpp=1, recompute="none", sp=sp, schedule="none")
    tokens, l, h = BENCH.seq, BENCH.layers, BENCH.hidden
    reduce = hw.cpu.link("all_reduce", 2)
    assert reduce.latency == pytest.approx((100 * WORLD + 20) * 1e-6)  # the P = 4, n = 2 fit
    one = collectives.all_reduce(2, tokens * h * 4, reduce)
    if sp:
        one = (collectives.all_gather(2, tokens * h * 4, hw.cpu.link("all_gather", 2))
               + collectives.reduce_scatter(2, tokens * h * 4, hw.cpu.link("reduce_scatter", 2)))
    loss = collectives.all_reduce(2, tokens * 4, reduce) + collectives.all_reduce(2, 2 * tokens * 4, reduce)
    norms = (2 * l + 1) * collectives.all_reduce(2, h * 4, reduce) if sp else 0.0
    per_micro_batch = (4 * l + 2) * one + loss + norms
    got = step_time(BENCH, layout, Cluster(hw, WORLD, WORLD), GLOBAL_BATCH).tp_comm
    assert got == pytest.approx(GLOBAL_BATCH // 2 * per_micro_batch, rel=1e-12)


def test_the_zero_layouts_map_onto_their_planner_layouts() -> None:
    def planner(name: str) -> Layout:
        return validate.layout_of(layout_fields(ParallelConfig(**LAYOUTS[name])), MICRO_BATCH_SIZE)

    assert planner("dp2-pp2-zero3") == Layout(
        tp=1, pp=2, dp=2, cp=1, zero=3, mbs=1, vpp=1, recompute="none", sp=False, schedule="1f1b")
    assert planner("dp2-tp2-zero2") == Layout(
        tp=2, pp=1, dp=2, cp=1, zero=2, mbs=1, vpp=1, recompute="none", sp=False, schedule="none")
    assert planner("dp2-tp2-sp-zero2") == dataclasses.replace(planner("dp2-tp2-zero2"), sp=True)


def bench_cluster(tmp_path: Path) -> Cluster:
    """4 processes on the synthetic profile with the bench model's layer pieces."""
    hw = load_profile(write(tmp_path, "profile.json", cpu_profile(pieces={BENCH: bench_pieces()})), WORLD)
    return Cluster(hw, WORLD, WORLD)


def dp_cost(cluster: Cluster, op: str, nbytes: float) -> float:
    """`op` over the dp group of 2 (of 4 processes) at the profile's fit."""
    assert cluster.hardware.cpu is not None
    return getattr(collectives, op)(2, nbytes, cluster.hardware.cpu.link(op, 2))


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_data_parallel_under_pp_is_charged_every_micro_batch_and_in_the_bubble(tmp_path: Path,
                                                                                        zero: int) -> None:
    """dp2 × pp2 1F1B, m = 4 micro-batches, Ψ the last stage's parameters (4 blocks, final norm, head):
    ZeRO-3 (units per stage) all-gathers Ψ for every forward, the 4 blocks again for every backward (the
    root unit stays gathered) and reduce-scatters Ψ; ZeRO-2 reduce-scatters Ψ every micro-batch and
    all-gathers once. The per-micro-batch part lengthens each pipeline slot: the bubble (p − 1 = 1 slot)
    grows by it over the same layout without ZeRO."""
    cluster = bench_cluster(tmp_path)
    layout = validate.layout_of(layout_fields(ParallelConfig(dp=2, pp=2, pp_schedule="1f1b", zero=zero)), 1)
    psi = 4 * stage_params(BENCH, layout, "last")
    assert psi == 4 * (4 * BENCH.layer_params + BENCH.head_params)
    if zero == 3:
        blocks = 4 * 4 * BENCH.layer_params
        per_micro_batch = (dp_cost(cluster, "all_gather", psi) + dp_cost(cluster, "all_gather", blocks)
                           + dp_cost(cluster, "reduce_scatter", psi))
        per_step = 0.0
    else:
        per_micro_batch, per_step = dp_cost(cluster, "reduce_scatter", psi), dp_cost(cluster, "all_gather", psi)
    sharded = step_time(BENCH, layout, cluster, GLOBAL_BATCH)
    plain = step_time(BENCH, dataclasses.replace(layout, zero=0), cluster, GLOBAL_BATCH)
    assert sharded.dp_comm == pytest.approx(4 * per_micro_batch + per_step, rel=1e-12)
    assert sharded.bubble - plain.bubble == pytest.approx(per_micro_batch, rel=1e-9)
    assert (sharded.compute, sharded.pp_comm) == (plain.compute, plain.pp_comm)


@pytest.mark.parametrize("sp", [False, True])
def test_zero2_under_tp_reduce_scatters_the_tp_shard_in_each_dp_group(tmp_path: Path, sp: bool) -> None:
    """dp2 × tp2 ZeRO-2, m = 4: each tp coordinate's dp group of 2 reduce-scatters its tp shard's gradient
    (Ψ/2) every micro-batch and all-gathers the updated shard once; sequence parallelism changes only tp."""
    cluster = bench_cluster(tmp_path)
    layout = validate.layout_of(layout_fields(ParallelConfig(dp=2, tp=2, zero=2, sequence_parallel=sp)), 1)
    shard = 4 * BENCH.total_params / 2
    assert 4 * stage_params(BENCH, layout, "only") == shard
    t = step_time(BENCH, layout, cluster, GLOBAL_BATCH)
    assert t.dp_comm == pytest.approx(4 * dp_cost(cluster, "reduce_scatter", shard)
                                      + dp_cost(cluster, "all_gather", shard), rel=1e-12)
    assert t.bubble == 0.0
    zero0 = step_time(BENCH, dataclasses.replace(layout, zero=0), cluster, GLOBAL_BATCH)
    assert (t.compute, t.tp_comm) == (zero0.compute, zero0.tp_comm)
