"""The layout search: rejection rules, fixed options, ranking (small clusters, so it stays fast)."""

from __future__ import annotations

import pytest

from ndtrain.errors import UserError
from ndtrain.plan import arch
from ndtrain.plan.hardware import Cluster, gpu
from ndtrain.plan.layout import Layout, problem
from ndtrain.plan.report import candidate_dict, explain, table
from ndtrain.plan.search import Fixed, search

FULL = dict(tp=2, pp=2, dp=2, cp=1, zero=1, mbs=1, vpp=1, recompute="full", sp=True, schedule="1f1b")


def test_every_candidate_fits_runs_on_the_world_and_is_ranked_by_speed() -> None:
    result = search(arch.PRESETS["llama3-8b"], Cluster(gpu("h100-sxm"), 8, 8), 64, Fixed(zero=1, mbs=1))
    assert result.candidates and all(c.fits for c in result.candidates)
    assert all(c.layout.world == 8 for c in result.candidates)
    speeds = [float(f"{c.tokens_per_s:.6g}") for c in result.candidates]  # ties to 6 digits: `_rank_key`
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.memory.total <= 80 * 1024**3 for c in result.candidates)
    assert result.rejections.counts["memory"] > 0  # e.g. tp1 pp1 with no recompute


def test_small_model_prefers_pure_data_parallelism() -> None:
    result = search(arch.PRESETS["gpt3-125m"], Cluster(gpu("a100-80gb"), 8, 8), 256, Fixed(mbs=4))
    best = result.candidates[0].layout
    assert (best.tp, best.pp, best.cp, best.dp) == (1, 1, 1, 8)


def test_huge_model_needs_model_parallelism() -> None:
    result = search(arch.PRESETS["gpt3-175b"], Cluster(gpu("a100-80gb"), 64, 8), 64,
                    Fixed(tp=8, mbs=1, recompute="selective", sp=True))
    best = result.candidates[0]
    assert best.fits and best.layout.pp * best.layout.dp == 8
    assert all(c.layout.tp == 8 and c.layout.recompute == "selective" for c in result.candidates)


def test_a_full_set_of_options_evaluates_exactly_that_layout() -> None:
    result = search(arch.PRESETS["llama2-7b"], Cluster(gpu("a100-80gb"), 8, 8), 16, Fixed(**FULL))
    assert [c.layout for c in result.candidates] == [Layout(**FULL)]
    assert result.considered == 1


def test_when_nothing_fits_the_smallest_layouts_are_shown_with_reasons() -> None:
    result = search(arch.PRESETS["llama3-405b"], Cluster(gpu("a100-40gb"), 8, 8), 8, Fixed(mbs=1))
    assert result.candidates and not any(c.fits for c in result.candidates)
    totals = [c.memory.total for c in result.candidates]
    assert totals == sorted(totals)
    text = explain(result)
    assert "0 fit" in text and "memory" in text and "e.g. tp" in text


def test_structural_problems() -> None:
    gpt = arch.PRESETS["gpt3-125m"]  # 12 heads, 12 layers
    base = dict(FULL, tp=1, pp=1, dp=8, schedule="none", sp=False)
    cases = {
        "world": dict(base, dp=4),
        "tp-heads": dict(base, tp=8, dp=1),
        "pp-layers": dict(base, pp=8, dp=1, vpp=2, schedule="interleaved"),
        "batch": dict(base, mbs=3),
        "sp": dict(base, sp=True),
        "schedule": dict(base, pp=2, dp=4, schedule="interleaved", vpp=1),
    }
    for kind, fields in cases.items():
        issue = problem(Layout(**fields), gpt, 8, 64)
        assert issue is not None and issue.kind == kind, (kind, issue)
    assert problem(Layout(**base), gpt, 8, 64) is None
    llama = arch.PRESETS["llama3-8b"]  # 8 kv heads, seq 8192
    assert problem(Layout(**dict(base, tp=8, dp=1)), llama, 8, 64) is None  # 32 heads, 8 kv heads
    assert problem(Layout(**dict(base, cp=8, dp=1)), llama, 8, 64) is None
    odd = arch.ModelSpec("o", "llama", 4, 512, 8, 8, 1024, 256, 24)
    assert problem(Layout(**dict(base, cp=8, dp=1)), odd, 8, 64).kind == "cp-seq"


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_1f1b_and_zb_need_as_many_micro_batches_as_stages(schedule: str) -> None:
    """ndtrain's pipeline refuses 1F1B and ZB-H1 with m < p (parallel/pipeline/schedules.check): the planner
    neither ranks nor chooses such a layout (`--layout auto` once chose pp4 with one micro-batch of 8)."""
    gpt = arch.PRESETS["gpt3-125m"]
    pipe = dict(FULL, tp=1, pp=4, dp=2, cp=1, schedule=schedule, sp=False, vpp=1)
    issue = problem(Layout(**dict(pipe, mbs=8)), gpt, 8, 16)  # m = 16 / (2·8) = 1 < 4
    assert issue is not None and issue.kind == "schedule" and "needs m ≥ p" in issue.message
    assert problem(Layout(**dict(pipe, mbs=2)), gpt, 8, 16) is None  # m = 4
    assert problem(Layout(**dict(pipe, mbs=8, schedule="gpipe")), gpt, 8, 16) is None  # GPipe runs m < p
    result = search(gpt, Cluster(gpu("a100-80gb"), 8, 8), 16, Fixed(pp=4))
    assert all(c.layout.micro_batches(16) >= 4 for c in result.candidates if c.layout.schedule in ("1f1b", "zb"))


@pytest.mark.parametrize("fixed, fragment", [
    (Fixed(tp=3), "--tp 3 does not divide --gpus 8"),
    (Fixed(tp=2, pp=2, dp=4), "--tp 2 × --pp 2 × --dp 4 = 16 does not divide --gpus 8"),
    (Fixed(**dict(FULL, mbs=3)), "global batch 16 is not divisible by dp×mbs = 2×3"),
    (Fixed(zero=4), "--zero 4 is not a ZeRO stage"),
    (Fixed(recompute="some"), "--recompute 'some' is unknown"),
    (Fixed(**dict(FULL, tp=8, pp=1, dp=1, schedule="none")), "tp=8 does not divide the 12 attention heads"),
])
def test_bad_fixed_options_are_user_errors(fixed: Fixed, fragment: str) -> None:
    with pytest.raises(UserError) as info:
        search(arch.PRESETS["gpt3-125m"], Cluster(gpu("a100-80gb"), 8, 8), 16, fixed)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_report_has_the_documented_json_keys_and_a_table_row_per_candidate() -> None:
    result = search(arch.PRESETS["llama2-7b"], Cluster(gpu("a100-80gb"), 8, 8), 16, Fixed(**FULL))
    entry = candidate_dict(result.candidates[0])
    assert set(entry["layout"]) == {"tp", "pp", "dp", "cp", "zero", "mbs", "vpp", "recompute", "sp", "schedule"}
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(entry["memory_gib"])
    for key in ("fits", "step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu"):
        assert key in entry
    assert entry["hardware_tflops_per_gpu"] > entry["model_tflops_per_gpu"]  # full recompute
    assert entry["mfu"] == pytest.approx(entry["model_tflops_per_gpu"] / 312, rel=1e-3)
    assert len(table(result, 10).splitlines()) == 2
