"""DDP's levers (issue 17 item 2): a small first bucket, buckets in the recorded gradient order, the flat
AdamW over the buckets and its update overlapped with the all-reduces.

Each lever is trained through the Engine on 2 ranks (2 micro-batches each) and compared with the
single-process reference (fp32 ≤ 1e-5; float64 ≤ 1e-12); the recorded order is rank 0's on every rank
even when the ranks recorded different orders; a flat-AdamW run resumes bit-identically and its
checkpoint's optimizer state loads into a plain AdamW run. One spawn for all of it. Single process:
FlatAdamW is bit-identical to torch.optim.AdamW with its exact arithmetic, and fused within rounding.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ndtrain.bench import ddp as bench_ddp
from ndtrain.bench.harness import BenchOptions
from ndtrain.config import ModelConfig, ParallelConfig, load_config
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.buckets import pack
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.flat_adamw import FlatAdamW, FusedAdamW
from tests.helpers.models import adamw, batch, make_llama, micro_batches
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import decay_groups, train_reference
from tests.helpers.runner import Spawns, case_result, init_method, run_each

WORLD, ACCUMULATION, STEPS, MAX_NORM = 2, 2, 3, 0.05
SMALL = {"bucket_mb": 0.01, "first_bucket_mb": 0.001}  # several buckets on the tiny model
CASES: dict[str, tuple[dict[str, Any], float, torch.dtype]] = {  # ParallelConfig options, grad_clip, dtype
    "first_bucket": (SMALL, MAX_NORM, torch.float32),
    "reordered": ({**SMALL, "reorder_buckets": True}, MAX_NORM, torch.float32),
    "flat_adamw_clipped": ({**SMALL, "flat_adamw": True}, MAX_NORM, torch.float32),
    "flat_adamw_overlap": ({**SMALL, "flat_adamw": True, "overlap_optimizer": True}, 0.0, torch.float32),
    "all_float64": ({**SMALL, "reorder_buckets": True, "flat_adamw": True, "overlap_optimizer": True}, 0.0, torch.float64),
}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
ZERO_CASES = {f"flat_adamw_zero{stage}": {"bucket_mb": 0.01, "zero": stage, "flat_adamw": True} for stage in (1, 2, 3)}


def _engine(ctx: Any, options: dict[str, Any], clip: float, dtype: torch.dtype) -> Engine:
    return Engine(lambda: make_llama(dtype), adamw, ctx, ParallelConfig(**options), grad_clip=clip)


def _train(engine: Engine, steps: range, rank: int) -> None:
    for step in steps:
        engine.train_step(micro_batches(step, rank, WORLD, ACCUMULATION))


def _case(ctx: Any, name: str) -> dict[str, Any]:
    options, clip, dtype = CASES[name]
    engine = _engine(ctx, options, clip, dtype)
    reduced: list[int] = []
    if isinstance(engine.optimizer, FlatAdamW) and engine.optimizer.overlapping:
        engine.optimizer.ddp.on_bucket_reduced = lambda k: (reduced.append(k), engine.optimizer.bucket_reduced(k))
    _train(engine, range(STEPS), ctx.rank)
    ddp = engine.wrapped
    return {"params": engine.full_state_dict(), "buckets": ddp.bucket_names(), "optimizer": type(engine.optimizer).__name__,
            "updated_in_backward": len(reduced), "bucket_count": ddp.bucket_count}


def _zero_case(ctx: Any, name: str) -> dict[str, Any]:
    """ZeRO-1/2/3 with `flat_adamw`: the optimizer over the shard's flat segments is torch's fused AdamW."""
    engine = _engine(ctx, ZERO_CASES[name], MAX_NORM, torch.float32)
    _train(engine, range(STEPS), ctx.rank)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeroOptimizer holds its inner optimizer
    return {"params": engine.full_state_dict(), "optimizer": type(inner).__name__,
            "fused": [bool(g["fused"]) for g in inner.param_groups]}


def _agreement(ctx: Any) -> list[list[str]]:
    """Rank 1 pretends its gradients arrived in reverse: every rank still packs rank 0's order."""
    ddp = DistributedDataParallel(make_llama(), ctx, **{k: v for k, v in SMALL.items()})
    x, y = batch(0)
    ddp(x, y).backward()
    if ctx.rank == 1:
        ddp._grads.arrival.reverse()
    ddp._reorder()
    return ddp.bucket_names()


def _resume(ctx: Any, root: str) -> dict[str, Any]:
    options, clip, dtype = CASES["flat_adamw_overlap"]
    engine = _engine(ctx, {**options, "reorder_buckets": True}, clip, dtype)
    _train(engine, range(2), ctx.rank)
    engine.save(root)
    _train(engine, range(2, 4), ctx.rank)
    resumed = _engine(ctx, {**options, "reorder_buckets": True}, clip, dtype)
    resumed.load(root)
    _train(resumed, range(2, 4), ctx.rank)
    plain = _engine(ctx, {}, clip, dtype)  # torch's AdamW: the flat state comes back under the parameters' names
    plain.load(root)
    names = dict(plain.model.named_parameters())
    states = {name: {k: v.clone() for k, v in plain.optimizer.state[p].items()} for name, p in names.items()}
    flat = _engine(ctx, {**options, "reorder_buckets": True}, clip, dtype)
    flat.load(root)
    flat_names = dict(flat.model.named_parameters())
    flat.optimizer._ensure_state(0)
    flat_states = {name: {k: v.clone() for k, v in flat.optimizer.state[p].items()} for name, p in flat_names.items()
                   if flat.optimizer.state[p]}
    return {"continued": engine.full_state_dict(), "resumed": resumed.full_state_dict(), "plain_state": states,
            "flat_state": flat_states}


def _bench(ctx: Any) -> dict[str, Any]:
    """`ndtrain bench ddp` with every lever on (and torch's fused AdamW): one short run."""
    options = BenchOptions(steps=2, warmup=1, repeats=1, bucket_mb=0.01, micro_batch=2, seq_len=16, preset="tiny",
                           first_bucket_mb=0.001, reorder_buckets=True, flat_adamw=True, overlap_optimizer=True,
                           torch_fused_adamw=True)
    return bench_ddp.run(ctx, options).to_json()


def _worker(root: str) -> dict[str, Any]:
    ctx = init(ParallelConfig(dp=WORLD), init_method=init_method())
    out = run_each(lambda name: _case(ctx, name), CASES)
    out.update(run_each(lambda name: _zero_case(ctx, name), ZERO_CASES))
    others = {"agreement": lambda: _agreement(ctx), "resume": lambda: _resume(ctx, root), "bench": lambda: _bench(ctx)}
    out.update(run_each(lambda name: others[name](), others))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return Spawns(_worker, timeout=240).get("all", WORLD, str(tmp_path_factory.mktemp("ddpfast") / "ckpt"))


@pytest.mark.parametrize("name", list(CASES))
def test_each_lever_keeps_parity_with_one_process(results: list[dict[str, Any]], name: str) -> None:
    options, clip, dtype = CASES[name]
    model = make_llama(dtype)
    reference = train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=WORLD * ACCUMULATION,
                                clip=clip if clip > 0 else float("inf"))
    runs = case_result(results, name)
    for rank, run in enumerate(runs):
        assert_params_close(run["params"], reference.state, TOLERANCE[dtype], f"{name} rank {rank}")
        assert run["bucket_count"] > 3
    assert runs[0]["buckets"] == runs[1]["buckets"]
    assert runs[0]["optimizer"] == ("FlatAdamW" if options.get("flat_adamw") else "AdamW")
    overlapped = options.get("overlap_optimizer", False)
    assert all(run["updated_in_backward"] == (STEPS * run["bucket_count"] if overlapped else 0) for run in runs)
    if options.get("reorder_buckets"):  # backward produces the head's gradient first and the embedding's last
        assert runs[0]["buckets"][0] == ["output.weight"] and runs[0]["buckets"][-1][-1] == "tok_embeddings.weight"


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_flat_adamw_runs_zero_on_the_fused_kernel_with_parity(results: list[dict[str, Any]], name: str) -> None:
    model = make_llama()
    reference = train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=WORLD * ACCUMULATION,
                                clip=MAX_NORM)
    for rank, run in enumerate(case_result(results, name)):
        assert_params_close(run["params"], reference.state, TOLERANCE[torch.float32], f"{name} rank {rank}")
        assert run["optimizer"] == "FusedAdamW" and run["fused"] == [True, True]  # decay and no-decay groups


def test_the_recorded_bucket_order_is_rank_0s_on_every_rank(results: list[dict[str, Any]]) -> None:
    first, second = case_result(results, "agreement")
    assert first == second
    assert first[0] == ["output.weight"]


def test_a_flat_adamw_run_resumes_bit_identically_and_its_state_loads_into_torch_adamw(results: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(case_result(results, "resume")):
        for name, tensor in run["continued"].items():
            assert torch.equal(run["resumed"][name], tensor), (rank, name)
        assert run["plain_state"].keys() >= run["flat_state"].keys() and run["flat_state"]
        for name, state in run["flat_state"].items():
            assert set(run["plain_state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(run["plain_state"][name][key], state[key]), (rank, name, key)
            assert float(state["step"]) == 2.0


def test_bench_ddp_with_every_lever_moves_the_ring_bytes_and_its_limit_none(results: list[dict[str, Any]]) -> None:
    data = case_result(results, "bench")[0]
    assert list(data["runs"]) == ["ours", "torch", "limit"]
    assert data["facts"]["levers"] == "reorder_buckets,flat_adamw,overlap_optimizer,torch_fused_adamw"
    assert data["summary"]["ours"]["comm_bytes_per_step"] == data["facts"]["ring_bytes"]
    assert data["summary"]["limit"]["comm_bytes_per_step"] == 0.0


MODEL = ModelConfig(preset="tiny", dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, seq_len=8)


@pytest.mark.parametrize("fused", [False, True])
def test_flat_adamw_is_torch_adamw_exactly_or_within_rounding_when_fused(fused: bool) -> None:
    ctx = init(ParallelConfig(dp=1))
    reference = build_model(MODEL, seed=0)
    torch_optimizer = torch.optim.AdamW(decay_groups(reference), lr=1e-2, weight_decay=0.1)
    ddp = DistributedDataParallel(build_model(MODEL, seed=0), ctx, bucket_mb=0.001, first_bucket_mb=0.0002)
    flat = FlatAdamW.replacing(ddp, torch.optim.AdamW(decay_groups(ddp.module), lr=1e-2, weight_decay=0.1), fused=fused)
    assert flat is not None and ddp.bucket_count > 3
    for step in range(4):
        x, y = batch(step)
        for model, optimizer in ((reference, torch_optimizer), (ddp, flat)):
            optimizer.zero_grad()
            model(x[:, :8], y[:, :8]).backward()
            optimizer.step()
    if fused:
        assert_params_close(ddp.module.state_dict(), reference.state_dict(), 1e-5, "fused flat AdamW")
    else:
        for name, tensor in reference.state_dict().items():
            assert torch.equal(ddp.module.state_dict()[name], tensor), name


def test_flat_adamw_keeps_an_optimizer_it_cannot_replace_and_overlap_needs_no_clipping() -> None:
    ctx = init(ParallelConfig(dp=1))
    ddp = DistributedDataParallel(build_model(MODEL, seed=0), ctx)
    assert FlatAdamW.replacing(ddp, torch.optim.AdamW(ddp.parameters(), amsgrad=True)) is None
    assert FlatAdamW.replacing(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)) is None
    with pytest.raises(UserError, match="overlap_optimizer=true needs parallel.flat_adamw=true"):
        ParallelConfig(overlap_optimizer=True).validate()
    with pytest.raises(UserError, match="set optim.grad_clip=0"):
        load_config(None, {"parallel.flat_adamw": True, "parallel.overlap_optimizer": True})
    load_config(None, {"parallel.flat_adamw": True, "parallel.overlap_optimizer": True, "optim.grad_clip": 0})
    for lever, other in (("reorder_buckets", dict(zero=1)), ("reorder_buckets", dict(precision="bf16"))):
        with pytest.raises(UserError, match=f"parallel.{lever}=true is a DDP lever for zero=0 in fp32"):
            ParallelConfig(**{lever: True}, **other).validate()
    ParallelConfig(flat_adamw=True, zero=1, precision="bf16").validate()  # the fused kernel over ZeRO's segments
    with pytest.raises(UserError, match="parallel.flat_adamw=true needs dp_mode=ddp"):
        ParallelConfig(flat_adamw=True, dp_mode="single-process").validate()
    assert FusedAdamW.replacing(torch.optim.SGD(ddp.parameters(), lr=0.1)) is None


def test_fused_adamw_stays_fused_when_it_loads_a_plain_adamws_state() -> None:
    """A run switched to `flat_adamw` resumes from a checkpoint saved without it: torch's
    load_state_dict would take `fused` from the saved groups; FusedAdamW keeps its kernel."""
    model = build_model(MODEL, seed=0)
    plain = torch.optim.AdamW(decay_groups(model), lr=1e-2, weight_decay=0.1)
    twin = build_model(MODEL, seed=0)
    for step in range(3):
        x, y = batch(step)
        if step == 2:  # the twin takes over the parameters and the plain optimizer's state
            twin.load_state_dict(model.state_dict())
            fused = FusedAdamW.replacing(torch.optim.AdamW(decay_groups(twin), lr=1e-2, weight_decay=0.1))
            assert fused is not None
            fused.load_state_dict(copy.deepcopy(plain.state_dict()))  # as from a checkpoint: no shared tensors
            assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
            twin(x[:, :8], y[:, :8]).backward()
            fused.step()
        plain.zero_grad()
        model(x[:, :8], y[:, :8]).backward()
        plain.step()
    assert all(fused.state[p]["step"].dtype == torch.float32 and fused.state[p]["step"].item() == 3 for p in twin.parameters())
    assert_params_close(twin.state_dict(), model.state_dict(), 1e-5, "fused after a plain AdamW's state")


def test_state_with_different_steps_in_one_bucket_is_one_line() -> None:
    ctx = init(ParallelConfig(dp=1))
    ddp = DistributedDataParallel(build_model(MODEL, seed=0), ctx)
    optimizer = FlatAdamW(ddp, list(ddp.parameters()))
    for step, param in enumerate(list(ddp.parameters())[:2], start=1):  # one bucket holds them all
        optimizer.state[param].update(step=torch.tensor(float(step)), exp_avg=torch.zeros_like(param),
                                      exp_avg_sq=torch.zeros_like(param))
    with pytest.raises(UserError, match=r"different step counts \[1.0, 2.0\] within one bucket"):
        optimizer.step()


def test_the_first_bucket_has_its_own_smaller_cap() -> None:
    tensors = [torch.zeros(4) for _ in range(10)]  # 16 bytes each
    assert pack(tensors, 64, first_cap_bytes=16) == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert pack(tensors, 64) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ctx = init(ParallelConfig(dp=1))
    whole = DistributedDataParallel(build_model(MODEL, seed=0), ctx, bucket_mb=1.0)
    split = DistributedDataParallel(build_model(MODEL, seed=0), ctx, bucket_mb=1.0, first_bucket_mb=0.001)
    assert whole.bucket_count == 1 and split.bucket_count == 2  # the head (16 KiB) alone is over the 1 KiB first cap
    assert split.bucket_names()[0] == ["output.weight"] and split.bucket_names()[1][0] == "norm.weight"
    assert DistributedDataParallel(build_model(MODEL, seed=0), ctx, bucket_mb=0.01, first_bucket_mb=1.0).bucket_bytes == \
        DistributedDataParallel(build_model(MODEL, seed=0), ctx, bucket_mb=0.01).bucket_bytes  # never above bucket_mb
