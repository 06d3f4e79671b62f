"""Bench harness and the data-parallel scenarios on 2 ranks with the tiny model: result structure, exact bytes,
the no-communication `limit` contestant, the noise warning and each contestant's memory in fresh workers.

No timing assertions: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.bench import ddp, fsdp, zero
from ndtrain.bench.harness import (
    MEMORY_STEPS, BenchOptions, Contestant, ContestResult, MemoryMeasured, RunRecord, adamw_factory, llama_workload,
    run_contest, spreads_overlap, training_step,
)
from ndtrain.bench.limit import local_model
from ndtrain.config import ParallelConfig, config_from_dict
from ndtrain.errors import UserError
from ndtrain.dist.host_slots import host_slots_supported
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.flat_adamw import FusedAdamW
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

OPTIONS = BenchOptions(steps=2, warmup=1, repeats=2, bucket_mb=0.01, micro_batch=2, seq_len=16, preset="tiny")


def _bench_worker(out: str) -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    result = ddp.run(ctx, OPTIONS)
    if ctx.is_main:
        result.write_json(Path(out))
        assert result.table().startswith("ddp on 2 ranks")
    return result.to_json()


def test_ddp_scenario_result_and_exact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "ddp-n2.json"
    results = run_distributed(_bench_worker, 2, str(out))
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(results[0]))
    assert results[0]["summary"] == results[1]["summary"]  # every rank gets the same result
    assert data["scenario"] == "ddp" and data["world_size"] == 2 and data["reference"] == "torch"
    assert data["options"]["preset"] == "tiny"
    facts = data["facts"]
    grad_bytes = facts["gradient_bytes"]
    assert grad_bytes == 4 * facts["parameters"]
    assert facts["ring_bytes"] == 2 * (2 - 1) * grad_bytes // 2
    assert list(data["runs"]) == ["ours", "torch", "limit"] and isinstance(data["warnings"], list)
    for name in ("ours", "torch", "limit"):
        runs = data["runs"][name]
        assert len(runs) == OPTIONS.repeats
        for run in runs:
            assert len(run["step_s"]) == OPTIONS.steps and all(t > 0 for t in run["step_s"])
            assert len(run["peak_bytes"]) == 2 and all(p >= b > 0 for p, b in zip(run["peak_bytes"], run["baseline_bytes"]))
            assert run["loopback_bytes_per_step"] is None or run["loopback_bytes_per_step"] > 0
            # only ours maps shared memory (its gradient slots): each rank maps half of the other's slot
            shared = run["shared_overcount_bytes"]
            assert all(v > 0 for v in shared) if name == "ours" and host_slots_supported() else shared == [0, 0], shared
        summary = data["summary"][name]
        assert set(summary) == {
            "median_step_s", "ratio", "ratio_to_limit", "run_median_step_s", "spread_step_s", "comm_bytes_per_step",
            "loopback_bytes_per_step", "peak_bytes", "peak_over_baseline_bytes", "peak_own_share_bytes",
        }
        assert summary["peak_own_share_bytes"] == [
            int(statistics.median(r["peak_bytes"][k] - r["shared_overcount_bytes"][k] for r in runs)) for k in range(2)]
        medians = summary["run_median_step_s"]
        assert summary["spread_step_s"] == [min(medians), max(medians)]
        assert summary["ratio_to_limit"] == summary["median_step_s"] / data["summary"]["limit"]["median_step_s"]
    assert data["summary"]["limit"]["ratio_to_limit"] == 1.0
    assert [r["comm_bytes_per_step"] for r in data["runs"]["limit"]] == [0.0] * OPTIONS.repeats
    assert data["summary"]["torch"]["ratio"] == 1.0
    assert data["summary"]["torch"]["comm_bytes_per_step"] is None
    # Ours: exactly the ring volume of the gradient per step, in every run.
    assert [r["comm_bytes_per_step"] for r in data["runs"]["ours"]] == [2 * (2 - 1) / 2 * grad_bytes] * OPTIONS.repeats


def _zero_worker() -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    result = zero.run(ctx, OPTIONS)
    assert result.table().startswith("zero1 on 2 ranks")
    return result.to_json()


def test_zero1_scenario_result_and_exact_bytes() -> None:
    results = run_distributed(_zero_worker, 2)
    data = json.loads(json.dumps(results[0]))
    assert results[0]["summary"] == results[1]["summary"] and results[0]["facts"] == results[1]["facts"]
    assert data["scenario"] == "zero1" and data["world_size"] == 2 and data["reference"] == "torch"
    facts = data["facts"]
    grad_bytes, padded = facts["gradient_bytes"], facts["padded_parameters"]
    assert grad_bytes == 4 * facts["parameters"] and facts["parameters"] <= padded and padded % 2 == 0
    assert facts["expected_state_bytes"] == 8 * facts["parameters"] // 2
    assert facts["reduce_scatter_bytes"] == facts["all_gather_bytes"] == 4 * padded // 2
    assert facts["comm_bytes"] == 2 * (2 - 1) * 4 * padded // 2  # 2(N-1)/N·4Ψ': DDP's volume
    # Rank 0's AdamW state: exp_avg + exp_avg_sq of its half (N = 2 splits Ψ' evenly), plus 4-byte step counters.
    ours_state = facts["ours_rank0_state_bytes"]
    assert ours_state >= 8 * (padded // 2 - (padded - facts["parameters"])) and ours_state % 4 == 0
    assert ours_state <= facts["expected_state_bytes"] + 8 * (padded - facts["parameters"]) + 4 * 1000
    assert 0 < facts["torch_rank0_state_bytes"] < 8 * facts["parameters"]
    assert [r["comm_bytes_per_step"] for r in data["runs"]["limit"]] == [0.0] * OPTIONS.repeats
    for name in ("ours", "torch", "limit"):
        runs = data["runs"][name]
        assert len(runs) == OPTIONS.repeats
        assert all(len(r["step_s"]) == OPTIONS.steps and len(r["peak_bytes"]) == 2 for r in runs)
    assert data["summary"]["torch"]["ratio"] == 1.0 and data["summary"]["torch"]["comm_bytes_per_step"] is None
    # Ours: exactly (N-1)/N·4Ψ' reduce-scatter + 4Ψ'/N of broadcasts (gloo's gather) per step, in every run:
    # 2(N-1)/N·4Ψ' at N = 2.
    assert [r["comm_bytes_per_step"] for r in data["runs"]["ours"]] == [facts["comm_bytes"]] * OPTIONS.repeats


def test_options_are_validated() -> None:
    with pytest.raises(UserError, match="--steps must be > 0"):
        BenchOptions(steps=0).validate()
    with pytest.raises(UserError, match="--model 'huge' is unknown"):
        BenchOptions(preset="huge").validate()


def _limit_worker() -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    """Trains the limit contestant's model 2 steps; returns its parameters, this rank's tokens and the counted bytes."""
    ctx = init(ParallelConfig(), init_method=init_method())
    work = llama_workload(ctx, OPTIONS)
    before = ctx.comm.stats.total_wire_bytes()
    model, optimizer = local_model(work, OPTIONS, ctx, zero.LR)
    step = training_step(model, optimizer, work.tokens)
    for i in range(2):
        step(i)
    counted = ctx.comm.stats.total_wire_bytes() - before
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, work.tokens, counted


def test_limit_trains_each_rank_locally_without_communication() -> None:
    (params0, tokens0, counted0), (params1, _, counted1) = run_distributed(_limit_worker, 2)
    assert counted0 == counted1 == 0
    # Rank 0's model is exactly a single-process run on rank 0's batches: the same compute, nothing received.
    # One thread, as the workers (tests/helpers/runner.py): the same kernels reduce in the same order.
    model_config = config_from_dict({"model": {"preset": OPTIONS.preset, "seq_len": OPTIONS.seq_len}}).model
    model = build_model(model_config, OPTIONS.seed, "cpu")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step = training_step(model, torch.optim.AdamW(model.parameters(), lr=zero.LR), tokens0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(2):
            step(i)
    finally:
        torch.set_num_threads(threads)
    assert_params_close(params0, model.state_dict(), 1e-6, "limit rank 0 vs local run")
    # It trained, and the ranks were never synchronised: their different data left different weights.
    changed = [k for k in initial if not torch.equal(initial[k], params0[k])]
    differ = [k for k in params0 if not torch.equal(params0[k], params1[k])]
    assert changed and differ and set(differ) == set(changed)


def _zero_levers_worker() -> list[dict[str, Any]]:
    """zero1, zero2 and zero3 once each, with every AdamW on torch's fused kernel (ours', the limit's, torch's)."""
    ctx = init(ParallelConfig(), init_method=init_method())
    once = dataclasses.replace(OPTIONS, repeats=1, flat_adamw=True, torch_fused_adamw=True)
    return [zero.run(ctx, once).to_json(), zero.run_zero2(ctx, once).to_json(), fsdp.run(ctx, once).to_json()]


def test_limit_is_in_every_zero_bench_with_zero_bytes_and_the_fused_adamw_levers_run() -> None:
    for data in run_distributed(_zero_levers_worker, 2)[0]:
        assert list(data["runs"]) == ["ours", "torch", "limit"], data["scenario"]
        assert data["facts"]["levers"] == "flat_adamw,torch_fused_adamw"
        assert data["summary"]["limit"]["comm_bytes_per_step"] == 0.0
        assert data["summary"]["ours"]["comm_bytes_per_step"] == data["facts"]["comm_bytes"]
        assert data["summary"]["ours"]["ratio_to_limit"] > 0


def test_adamw_factory_is_torch_adamw_fused_on_request() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    plain, fused = adamw_factory(zero.LR, False)(params), adamw_factory(zero.LR, True)(params)
    assert type(plain) is torch.optim.AdamW and not plain.param_groups[0]["fused"]
    assert isinstance(fused, FusedAdamW) and fused.param_groups[0]["fused"] and fused.param_groups[0]["lr"] == zero.LR


def _result(medians: dict[str, list[float]]) -> ContestResult:
    """A result whose contestants' runs have the given per-run medians (3 steps per run around each)."""
    result = ContestResult("ddp", 2, "torch", {}, {})
    result.runs = {name: [RunRecord([m * 0.9, m, m * 1.2], 0.0, None, [1, 1], [1, 1], [0, 0]) for m in runs]
                   for name, runs in medians.items()}
    return result


def test_noise_warning_rule() -> None:
    assert spreads_overlap([1.0, 2.0], [2.0, 3.0]) and spreads_overlap([1.0, 4.0], [2.0, 3.0])
    assert not spreads_overlap([1.0, 1.9], [2.0, 3.0]) and not spreads_overlap([2.1, 3.0], [1.0, 2.0])
    separated = _result({"ours": [0.100, 0.104, 0.102], "torch": [0.110, 0.115, 0.112], "limit": [0.090, 0.095]})
    assert separated.summary()["ours"]["spread_step_s"] == [0.100, 0.104]
    assert separated.noise_warnings() == [] and "warning" not in separated.table()
    noisy = _result({"ours": [0.100, 0.111, 0.102], "torch": [0.110, 0.115, 0.112], "limit": [0.090, 0.101]})
    warnings = noisy.noise_warnings()
    assert warnings == [
        "too noisy to separate ours from torch: run medians 100.0–111.0 ms vs 110.0–115.0 ms overlap",
        "too noisy to separate ours from limit: run medians 100.0–111.0 ms vs 90.0–101.0 ms overlap",
    ]
    assert noisy.to_json()["warnings"] == warnings
    assert all(f"warning: {w}" in noisy.table() for w in warnings)
    # Without a limit contestant (tp, pp, ...): no /limit ratio, only the reference is compared.
    plain = _result({"ours": [0.100, 0.111], "torch": [0.110, 0.115]})
    assert plain.summary()["ours"]["ratio_to_limit"] is None and len(plain.noise_warnings()) == 1


def test_a_memory_run_builds_only_its_contestant_once() -> None:
    """`memory_of`: the named contestant alone, built once, warmup + at most MEMORY_STEPS steps, then
    MemoryMeasured with its run (no discarded run, no repeats); an unknown name is a user error."""
    ctx = init(ParallelConfig())
    steps: dict[str, list[int]] = {"ours": [], "torch": []}

    def contestant(name: str) -> Contestant:
        return Contestant(name, lambda: steps[name].append, counted=True)

    options = dataclasses.replace(OPTIONS, steps=MEMORY_STEPS + 3, memory_of="torch")
    with pytest.raises(MemoryMeasured) as measured:
        run_contest(ctx, "t", [contestant("ours"), contestant("torch")], options, reference="torch", facts={})
    assert steps == {"ours": [], "torch": list(range(OPTIONS.warmup + MEMORY_STEPS))}
    record = measured.value.record
    assert len(record.step_s) == MEMORY_STEPS and record.peak_bytes[0] >= record.baseline_bytes[0] > 0
    with pytest.raises(UserError, match=r"--memory-of 'limit': the contestants are \['ours', 'torch'\]"):
        run_contest(ctx, "t", [contestant("ours"), contestant("torch")], dataclasses.replace(options, memory_of="limit"),
                    reference="torch", facts={})


@pytest.mark.slow  # 16 s of fresh launches; what a memory run builds is checked in CI (test_a_memory_run_builds_only_its_contestant_once)
def test_bench_measures_each_contestants_memory_in_fresh_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ndtrain bench zero3`: after the contest, one launch per contestant adds its fresh-process peaks per
    rank to the JSON summary and prints them."""
    from ndtrain.cli import commands as cli

    out = tmp_path / "zero3.json"
    argv = ["bench", "zero3", "--nproc", "2", "--device", "cpu", "--model", "tiny", "--steps", "2", "--warmup", "1",
            "--repeats", "1", "--seq-len", "16", "--out", str(out)]
    assert cli.main(argv) == 0
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["ours", "torch", "limit"]
    for s in summary.values():
        memory = s["fresh_memory"]
        assert set(memory) == {"peak_bytes", "peak_over_baseline_bytes", "peak_own_share_bytes"}
        assert all(len(v) == 2 for v in memory.values())
        assert all(p >= o > 0 and p >= own > 0 for p, o, own in zip(*memory.values()))
    printed = capsys.readouterr().out
    assert "each contestant alone in fresh worker processes (build + 3 steps)" in printed
    assert all(f"\n{name} " in printed for name in summary)
