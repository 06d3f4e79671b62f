"""Bench harness and the `ddp` scenario on 2 ranks with the tiny model: result structure and exact bytes.

No timing assertions: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ndtrain.bench import ddp, zero
from ndtrain.bench.harness import BenchOptions
from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.mesh import init
from tests.distributed import init_method, run_distributed

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
    for name in ("ours", "torch"):
        runs = data["runs"][name]
        assert len(runs) == OPTIONS.repeats
        for run in runs:
            assert len(run["step_s"]) == OPTIONS.steps and all(t > 0 for t in run["step_s"])
            assert len(run["peak_bytes"]) == 2 and all(p >= b > 0 for p, b in zip(run["peak_bytes"], run["baseline_bytes"]))
            assert run["loopback_bytes_per_step"] is None or run["loopback_bytes_per_step"] > 0
        summary = data["summary"][name]
        assert set(summary) == {
            "median_step_s", "ratio", "run_median_step_s", "comm_bytes_per_step", "loopback_bytes_per_step",
            "peak_bytes", "peak_over_baseline_bytes",
        }
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
    assert facts["all_reduce_bytes"] == grad_bytes and facts["all_gather_bytes"] == 4 * padded // 2
    assert facts["comm_bytes"] == facts["all_reduce_bytes"] + facts["all_gather_bytes"]
    # Rank 0's AdamW state: exp_avg + exp_avg_sq of its half (N = 2 splits Ψ' evenly), plus 4-byte step counters.
    ours_state = facts["ours_rank0_state_bytes"]
    assert ours_state >= 8 * (padded // 2 - (padded - facts["parameters"])) and ours_state % 4 == 0
    assert ours_state <= facts["expected_state_bytes"] + 8 * (padded - facts["parameters"]) + 4 * 1000
    assert 0 < facts["torch_rank0_state_bytes"] < 8 * facts["parameters"]
    for name in ("ours", "torch"):
        runs = data["runs"][name]
        assert len(runs) == OPTIONS.repeats
        assert all(len(r["step_s"]) == OPTIONS.steps and len(r["peak_bytes"]) == 2 for r in runs)
    assert data["summary"]["torch"]["ratio"] == 1.0 and data["summary"]["torch"]["comm_bytes_per_step"] is None
    # Ours: exactly 2(N-1)/N·4Ψ all-reduce + (N-1)/N·4Ψ' all-gather per step, in every run.
    expected = 2 * (2 - 1) / 2 * grad_bytes + (2 - 1) / 2 * 4 * padded
    assert [r["comm_bytes_per_step"] for r in data["runs"]["ours"]] == [expected] * OPTIONS.repeats


def test_options_are_validated() -> None:
    with pytest.raises(UserError, match="--steps must be > 0"):
        BenchOptions(steps=0).validate()
    with pytest.raises(UserError, match="--model 'huge' is unknown"):
        BenchOptions(preset="huge").validate()
