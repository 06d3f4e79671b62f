"""Pipeline parallel on gloo: every schedule equals the single-process model (loss and gradients),
at p=2 and p=4 with uneven layer counts, tied embeddings, a sequential model, dp=2×pp=2 AdamW
training, and bad input failing with UserError on every rank instead of hanging.

One spawn per world size (a module fixture) runs every scenario; the parent computes the references.
The dp×pp AdamW training and its reference run in float64 (`TRAIN_DTYPE`): in fp32 the CPU kernels'
summation order, amplified by AdamW on near-cancelling gradients, alone came within 2× of the 1e-5
bound (tests/test_zero.py); in float64 that noise is ~1e-14.
"""

from __future__ import annotations

from typing import Any


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.parallel.placement import placement_or_whole
from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.pipeline import eval_pipeline, is_pipeline_duplicate, run_pipeline, split_model
from ndtrain.parallel.model.tp_plan import parallelize
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import train_reference
from tests.helpers.runner import init_method, run_distributed

SEED = 7
TOLERANCE = 1e-5
STEPS = 3
LR = 1e-2
TRAIN_DTYPE = torch.float64  # of the dp×pp AdamW training and its reference (see the docstring)

Grads = dict[str, torch.Tensor]
# (schedule, virtual stages, layers, tied embeddings): layer counts that do not divide evenly
P2_CASES = [("naive", 1, 5, False), ("gpipe", 1, 5, False), ("1f1b", 1, 5, True), ("interleaved", 2, 5, False),
            ("zb", 1, 5, True)]
P4_CASES = [("naive", 1, 6, False), ("gpipe", 1, 6, True), ("1f1b", 1, 6, False), ("interleaved", 2, 9, True),
            ("zb", 1, 6, False)]


pytestmark = pytest.mark.usefixtures("one_thread")


def model_config(layers: int, tied: bool = False) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=16,
                       tie_embeddings=tied)


def micro_batches(m: int, seed: int, batch: int = 2, seq: int = 16, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (m, batch, seq + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def sequential_model() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)), nn.Linear(8, 3))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def sequential_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(m)]


def _grads(stages: list[nn.Module]) -> Grads:
    return {name: p.grad.clone() for s in stages for name, p in s.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------ workers
def _schedules_worker(p: int, cases: list[tuple[str, int, int, bool]]) -> dict[str, Any]:
    ctx = init(ParallelConfig(pp=p), init_method=init_method())  # later init()s reuse the world
    out: dict[str, Any] = {}
    for schedule, v, layers, tied in cases:
        stages = split_model(build_model(model_config(layers, tied), SEED), ctx, virtual=v)
        m = 2 * p
        loss = run_pipeline(stages, micro_batches(m, SEED), ctx, schedule)
        # a second call accumulates: gradients double, as with single-process accumulation
        grads_once = _grads(stages)
        run_pipeline(stages, micro_batches(m, SEED), ctx, schedule)
        doubled = _grads(stages)
        dup = sorted(n for s in stages for n, q in s.named_parameters() if is_pipeline_duplicate(q))
        out[f"{schedule}/v{v}/L{layers}/tied{tied}"] = (loss.item(), grads_once, doubled, dup)
    for v in (1, 2):  # evaluation: m = 3 need not be a multiple of p; nothing accumulates into .grad
        stages = split_model(build_model(model_config(2 * p + 1, tied=True), SEED), ctx, virtual=v)
        loss = eval_pipeline(stages, micro_batches(3, SEED + 1), ctx)
        out[f"eval/v{v}"] = (loss.item(), all(q.grad is None for s in stages for q in s.parameters()))
    seq_stages = split_model(sequential_model(), ctx, loss_fn=mse)
    loss = run_pipeline(seq_stages, sequential_batches(2 * p), ctx, "1f1b")
    out["sequential"] = (loss.item(), _grads(seq_stages))
    out["errors"] = _bad_inputs(ctx, p)
    return out


def _bad_inputs(ctx: Any, p: int) -> list[str]:
    """Each mistake must raise UserError on every rank before any communication."""
    errors = []
    stages = split_model(build_model(model_config(4), SEED), ctx)
    attempts = [
        lambda: split_model(build_model(model_config(p - 1 if p > 1 else 1), SEED), ctx),  # fewer layers than stages
        lambda: split_model(build_model(model_config(4), SEED), ctx, virtual=3),  # 4 layers < 3p stages
        lambda: run_pipeline(stages, micro_batches(p - 1, 0), ctx, "1f1b"),  # m < p
        lambda: run_pipeline(stages, micro_batches(p - 1, 0), ctx, "zb"),
        lambda: run_pipeline(split_model(build_model(model_config(4), SEED), ctx, virtual=2),
                             micro_batches(p + 1, 0), ctx, "interleaved"),  # m % p
        lambda: run_pipeline(stages, micro_batches(p, 0), ctx, "nonsense"),
    ]
    for attempt in attempts:
        try:
            attempt()
            errors.append("no error")
        except UserError as e:
            errors.append(str(e))
    run_pipeline(stages, micro_batches(p, 0), ctx, "gpipe")  # the group still works: nothing was half-sent
    return errors


def _world4_worker() -> dict[str, Any]:
    """Every 4-rank scenario in one spawn: pp=4 schedules, dp=2×pp=2, pp=2×tp=2 (± sequence parallel)."""
    return {"schedules": _schedules_worker(4, P4_CASES), "dp_pp": _dp_pp_worker(),
            "pp_tp": {sp: _pp_tp_worker(sp) for sp in (False, True)}}


def _dp_pp_worker() -> dict[str, torch.Tensor]:
    ctx = init(ParallelConfig(dp=2, pp=2), init_method=init_method())
    dp = ctx.coord("dp")
    model = build_model(model_config(3, tied=True), SEED).to(TRAIN_DTYPE)
    stages = [DistributedDataParallel(s, ctx) for s in split_model(model, ctx)]
    params = [q for s in stages for q in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR)
    for step in range(STEPS):
        batches = micro_batches(8, 100 + step)[dp * 4 : dp * 4 + 4]  # this dp rank's half of the step
        run_pipeline(stages, batches, ctx, ("1f1b", "zb", "gpipe")[step % 3])
        optimizer.step()
        for s in stages:
            s.zero_grad()
    return {name: q.detach().clone() for s in stages for name, q in s.module.named_parameters()}


def _pp_tp_worker(sequence_parallel: bool) -> tuple[float, dict[str, tuple[torch.Tensor, Any]]]:
    ctx = init(ParallelConfig(pp=2, tp=2), init_method=init_method())
    model = parallelize(build_model(model_config(3, tied=True), SEED), ctx, sequence_parallel=sequence_parallel)
    stages = split_model(model, ctx)
    del model
    loss = run_pipeline(stages, micro_batches(4, SEED), ctx, "1f1b")
    grads = {n: (q.grad.clone(), placement_or_whole(q).tp) for s in stages for n, q in s.named_parameters()}
    return loss.item(), grads


# ------------------------------------------------------------------------------------------ references
def reference(cfg: ModelConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, Grads]:
    model = build_model(cfg, SEED)
    losses = [model(x, y) for x, y in batches]
    (sum(losses) / len(losses)).backward()
    grads = {n: q.grad for n, q in model.named_parameters()}
    if cfg.tie_embeddings:
        grads["output.weight"] = grads["tok_embeddings.weight"]
    return float(sum(loss.item() for loss in losses)) / len(losses), grads  # run_pipeline's: the mean


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = ((got - want).norm() / want.norm()).item()
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e}"


def check_schedules(p: int, cases: list[tuple[str, int, int, bool]], results: list[dict[str, Any]]) -> None:
    for schedule, v, layers, tied in cases:
        key = f"{schedule}/v{v}/L{layers}/tied{tied}"
        ref_loss, ref = reference(model_config(layers, tied), micro_batches(2 * p, SEED))
        seen: set[str] = set()
        for rank, result in enumerate(results):
            loss, grads, doubled, dup = result[key]
            assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), f"{key} rank {rank}: loss {loss} vs {ref_loss}"
            for name, g in grads.items():
                assert_close(g, ref[name], f"{key} rank {rank} {name}")
                assert_close(doubled[name], 2 * ref[name], f"{key} rank {rank} {name} accumulated")
            seen |= set(grads)
            assert dup == (["output.weight"] if tied and rank == p - 1 else []), (key, rank, dup)
        assert seen == set(ref), f"{key}: parameters {sorted(set(ref) ^ seen)} missing or extra"
    seq = sequential_model()
    batches = sequential_batches(2 * p)
    losses = [mse(seq(x), y) for x, y in batches]
    (sum(losses) / len(losses)).backward()
    ref_seq = {n: q.grad for n, q in seq.named_parameters()}
    got = {}
    for result in results:
        assert abs(result["sequential"][0] - sum(l.item() for l in losses) / len(losses)) <= 1e-5
        got.update({n.removeprefix("layers."): g for n, g in result["sequential"][1].items()})
    assert set(got) == set(ref_seq)
    for n in ref_seq:
        assert_close(got[n], ref_seq[n], f"sequential {n}")
    with torch.no_grad():
        model = build_model(model_config(2 * p + 1, tied=True), SEED)
        eval_loss = sum(model(x, y).item() for x, y in micro_batches(3, SEED + 1)) / 3
    for result in results:
        for v in (1, 2):
            loss, no_grads = result[f"eval/v{v}"]
            assert abs(loss - eval_loss) <= TOLERANCE * eval_loss and no_grads
    for result in results:
        assert "no error" not in result["errors"], result["errors"]
        assert all("\n" not in e for e in result["errors"])


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_distributed(_schedules_worker, 2, 2, P2_CASES)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_distributed(_world4_worker, 4, timeout=300)  # four scenarios in one spawn


def test_every_schedule_matches_single_process_p2(world2: list[dict[str, Any]]) -> None:
    check_schedules(2, P2_CASES, world2)


def test_every_schedule_matches_single_process_p4(world4: list[dict[str, Any]]) -> None:
    check_schedules(4, P4_CASES, [r["schedules"] for r in world4])


def test_dp2_pp2_adamw_training_equals_single_process(world4: list[dict[str, Any]]) -> None:
    results = [r["dp_pp"] for r in world4]
    cfg = model_config(3, tied=True)
    model = build_model(cfg, SEED).to(TRAIN_DTYPE)
    steps = [micro_batches(8, 100 + step) for step in range(STEPS)]
    batches = [(torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])) for step in steps]
    want = train_reference(model, torch.optim.AdamW(model.parameters(), lr=LR), batches, pieces=8).params
    want["output.weight"] = want["tok_embeddings.weight"]
    for rank, params in enumerate(results):
        assert {t.dtype for t in params.values()} == {TRAIN_DTYPE}
        assert_params_close(params, {name: want[name] for name in params}, TOLERANCE, f"dp×pp rank {rank}")
    assert set(results[0]) | set(results[1]) == set(want)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pp2_tp2_matches_single_process(world4: list[dict[str, Any]], sequence_parallel: bool) -> None:
    ref_loss, ref = reference(model_config(3, tied=True), micro_batches(4, SEED))
    seen = set()
    for rank, result in enumerate(world4):
        loss, grads = result["pp_tp"][sequence_parallel]
        assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), f"rank {rank}: loss {loss} vs {ref_loss}"
        for name, (g, shard) in grads.items():
            want = ref[name] if shard is None else ref[name].narrow(shard.dim, shard.start, shard.length)
            assert_close(g, want, f"pp×tp rank {rank} {name}")
        seen |= set(grads)
    assert seen == set(ref)
