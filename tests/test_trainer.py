"""The training loop: accumulation, data-parallel parity, exact resume, exact distributed eval."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ndtrain.errors import UserError
from ndtrain.dist.host_slots import host_slots_supported
from ndtrain.dist.mesh import init
from ndtrain.trainer import Trainer
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file, tiny_config, train


def test_gradient_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    big = train(tiny_config(data, str(tmp_path / "big"), **{"schedule.micro_batch": 8, "parallel.dp": 1}), torch.float64)
    accumulated = train(tiny_config(data, str(tmp_path / "acc"), **{"schedule.micro_batch": 2, "parallel.dp": 1}),
                        torch.float64)
    assert_params_close(accumulated, big, 1e-5, "accumulated")


def _dp_worker(data: str, out: str, steps: int, micro: int) -> dict[str, torch.Tensor]:
    return train(tiny_config(data, out, **{"schedule.steps": steps, "schedule.micro_batch": micro}), torch.float64)


def test_data_parallel_training_equals_single_process(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    reference = train(tiny_config(data, str(tmp_path / "ref"), **{"parallel.dp": 1, "schedule.micro_batch": 8}), torch.float64)
    ranks = run_distributed(_dp_worker, 2, data, str(tmp_path / "dp2"), 6, 2)
    assert torch.equal(ranks[0]["layers.0.attention.wq.weight"], ranks[1]["layers.0.attention.wq.weight"])
    assert_params_close(ranks[0], reference, 1e-5, "rank 0")
    metrics = [json.loads(line) for line in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]


def _resume_worker(data: str, root: str) -> tuple[dict, dict, list, list]:
    full = train(tiny_config(data, f"{root}/full", **{"schedule.steps": 10}))
    train(tiny_config(data, f"{root}/split", **{"schedule.steps": 10, "checkpoint.exit_after": 5}))
    resumed = train(tiny_config(data, f"{root}/split", **{"schedule.steps": 10, "checkpoint.resume": True}))
    read = lambda name: [json.loads(l) for l in Path(f"{root}/{name}/metrics.jsonl").read_text().splitlines()]
    return full, resumed, read("full"), read("split")


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    full, resumed, full_log, split_log = run_distributed(_resume_worker, 2, corpus_file(tmp_path), str(tmp_path))[0]
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    losses = lambda log: [(m["step"], m["loss"]) for m in log if "loss" in m]
    assert losses(split_log) == losses(full_log)
    assert [p.name for p in sorted((tmp_path / "split" / "checkpoints").iterdir())] == [
        "latest", "step_00000005", "step_00000010"
    ]


def _eval_worker(data: str, out: str, samples: int, zero: int) -> tuple[float, int, float | None, int]:
    cfg = tiny_config(data, out, **{"data.eval_samples": samples, "schedule.global_batch": 12,
                                    "schedule.micro_batch": 2, "parallel.zero": zero})
    trainer = Trainer(cfg, init(cfg.parallel, init_method=init_method()))
    evaluation = trainer.engine.evaluate(trainer.eval_batches())
    return evaluation.loss, evaluation.tokens, evaluation.accuracy, len(list(trainer.eval_batches()))


@pytest.mark.parametrize("zero", [0, 3])
def test_distributed_eval_counts_every_token_once(tmp_path: Path, zero: int) -> None:
    """7 windows over 3 ranks: shards of 3/2/2 windows, 2/1/1 micro-batches of 2. ZeRO-3 all-gathers
    parameters in every forward, so the ranks with fewer batches must pad (a hang before the fix); the
    padding forwards count toward neither the loss nor the next-token accuracy."""
    data = corpus_file(tmp_path)
    cfg = tiny_config(data, str(tmp_path / "one"), **{"data.eval_samples": 7, "parallel.dp": 1})
    trainer = Trainer(cfg, init(cfg.parallel))
    reference = trainer.engine.evaluate(trainer.eval_batches())
    assert reference.tokens == 7 * cfg.model.seq_len and reference.accuracy is not None
    results = run_distributed(_eval_worker, 3, data, str(tmp_path / "three"), 7, zero)
    assert sorted(batches for *_, batches in results) == [1, 1, 2]
    for loss, tokens, accuracy, _ in results:
        assert tokens == reference.tokens
        assert loss == pytest.approx(reference.loss, rel=1e-6)
        assert accuracy == pytest.approx(reference.accuracy, abs=1e-12)


def test_resume_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = corpus_file(tmp_path)
    with pytest.raises(UserError, match="no checkpoint in"):
        train(tiny_config(data, str(tmp_path / "new"), **{"parallel.dp": 1, "checkpoint.resume": True}))
    out = tmp_path / "done"
    train(tiny_config(data, str(out), **{"parallel.dp": 1, "schedule.steps": 2}))
    with pytest.raises(UserError, match="already complete at step 2"):
        train(tiny_config(data, str(out), **{"parallel.dp": 1, "schedule.steps": 2}))
    # A crash in the middle of a save leaves a partial directory: the complete checkpoint still loads.
    shutil.copytree(out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000004.partial")
    train(tiny_config(data, str(out), **{"parallel.dp": 1, "schedule.steps": 3}))
    # A damaged checkpoint is named, not a traceback, and the newest verified one is used instead.
    for f in (out / "checkpoints" / "step_00000003").glob("*.distcp"):
        f.write_bytes(b"garbage")
    capsys.readouterr()
    train(tiny_config(data, str(out), **{"parallel.dp": 1, "schedule.steps": 4}))
    captured = capsys.readouterr()
    assert "step_00000003' is damaged (file __0_0.distcp has 7 bytes" in captured.err
    assert "ndtrain: resuming at step 2" in captured.out


def _zero1_worker(data: str, root: str) -> tuple[dict, dict, dict, list[int]]:
    zero = {"parallel.zero": 1, "parallel.bucket_mb": 0.01}  # several buckets, sizes not divisible by 2
    sharded = train(tiny_config(data, f"{root}/zero", **{"schedule.micro_batch": 2, **zero}), torch.float64)
    full = train(tiny_config(data, f"{root}/full", **{"schedule.steps": 10, **zero}))
    train(tiny_config(data, f"{root}/split", **{"schedule.steps": 10, "checkpoint.exit_after": 5, **zero}))
    resumed = train(tiny_config(data, f"{root}/split", **{"schedule.steps": 10, **zero}))
    step = Path(f"{root}/split/checkpoints/step_00000010")
    shards = sorted(p.name for p in step.glob("*.distcp") if p.stat().st_size > 0)
    return sharded, full, resumed, shards


def test_zero1_training_equals_single_process_and_resumes_exactly(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    reference = train(tiny_config(data, str(tmp_path / "ref"), **{"parallel.dp": 1, "schedule.micro_batch": 8}), torch.float64)
    sharded, full, resumed, shards = run_distributed(_zero1_worker, 2, data, str(tmp_path))[0]
    assert_params_close(sharded, reference, 1e-5, "sharded")
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own slices


def _state_bytes_worker(data: str, out: str, zero: int) -> dict[str, int]:
    cfg = tiny_config(data, out, **{"parallel.zero": zero, "schedule.steps": 1})
    trainer = Trainer(cfg, init(cfg.parallel, init_method=init_method()))
    trainer.run()
    return trainer.engine.model_state_bytes()


def test_model_state_bytes_follow_the_zero_formulas(tmp_path: Path) -> None:
    """fp32 AdamW: 4Ψ parameters, 4Ψ gradients, and 8Ψ of optimizer state (8Ψ/N with ZeRO-1); ZeRO-1 on
    one CPU host also holds its reduced gradient shard, 4Ψ'/N, from backward to the next zero_grad."""
    data = corpus_file(tmp_path)
    psi = 34_976  # the tiny preset
    plain = run_distributed(_state_bytes_worker, 2, data, str(tmp_path / "z0"), 0)
    sharded = run_distributed(_state_bytes_worker, 2, data, str(tmp_path / "z1"), 1)
    step_counters = 4  # AdamW's per-tensor `step` (one fp32 scalar per parameter tensor or ZeRO segment)
    for rank in range(2):
        assert plain[rank]["parameters"] == sharded[rank]["parameters"] == 4 * psi
        assert plain[rank]["gradients"] == 4 * psi
        shard = -(-psi // 2) if host_slots_supported() else 0  # one bucket (25 MB cap): ⌈Ψ/N⌉ elements
        assert sharded[rank]["gradients"] == 4 * (psi + shard)
        assert plain[rank]["optimizer"] == 8 * psi + step_counters * 21  # 21 parameter tensors
    # Every real element has its two moments on exactly one rank, plus one step counter per segment.
    assert 0 < sum(r["optimizer"] for r in sharded) - 8 * psi <= step_counters * 2 * 21
    for rank in range(2):
        assert abs(sharded[rank]["optimizer"] - 8 * psi / 2) <= 0.05 * 8 * psi / 2



SHARDED_RUNS = {"zero2": {"parallel.zero": 2}, "zero3": {"parallel.zero": 3},
                "zero2-fp16": {"parallel.zero": 2, "parallel.precision": "fp16"}}


def _sharded_resume_worker(data: str, root: str) -> dict[str, dict[str, object]]:
    """Per layout of SHARDED_RUNS: an uninterrupted run and one stopped after 2 steps and resumed, both to step 4."""

    def run(out: str, parallel: dict[str, object], **more: object) -> dict[str, torch.Tensor]:
        cfg = tiny_config(data, out, **{"parallel.bucket_mb": 0.01, "schedule.micro_batch": 2, "schedule.steps": 4,
                                        **parallel, **more})
        trainer = Trainer(cfg, init(cfg.parallel, init_method=init_method()))
        trainer.run()
        return trainer.engine.full_state_dict()

    results = {}
    for name, parallel in SHARDED_RUNS.items():
        full = run(f"{root}/{name}/full", parallel)
        run(f"{root}/{name}/split", parallel, **{"checkpoint.exit_after": 2})
        resumed = run(f"{root}/{name}/split", parallel)
        step = Path(f"{root}/{name}/split/checkpoints/step_00000004")
        files = sorted(p.name for p in step.glob("*.distcp") if p.stat().st_size > 0)
        metrics = [json.loads(line) for line in Path(f"{root}/{name}/split/metrics.jsonl").read_text().splitlines()]
        results[name] = {"full": full, "resumed": resumed, "files": files, "metrics": metrics}
    return results


def test_sharded_runs_resume_exactly(tmp_path: Path) -> None:
    """zero=2, zero=3, zero=2 + fp16: save → resume equals uninterrupted training; each rank wrote its own shards."""
    data = corpus_file(tmp_path)
    out = run_distributed(_sharded_resume_worker, 2, data, str(tmp_path))
    ranks = ["__0_0.distcp", "__1_0.distcp"]
    for name in SHARDED_RUNS:
        for o in out:
            for key in o[name]["full"]:
                assert torch.equal(o[name]["full"][key], o[name]["resumed"][key]), (name, key)
        assert out[0][name]["files"] == ranks
        steps = [m for m in out[0][name]["metrics"] if "loss" in m]
        assert [m["step"] for m in steps] == [1, 2, 3, 4]
        assert all(m["skipped"] is False for m in steps)
        assert steps[0]["loss_scale"] == (2.0**16 if name.endswith("fp16") else 1.0)
