"""Context parallel: ring attention and the whole model against the unsharded computation.

Two spawns: 2 ranks (cp=2: ring attention, whole-model loss and gradients with and without
recompute, saved-activation bytes, `bench cp`) and 4 ranks (cp=4 ring attention and bytes;
dp=2 × cp=2 training with our DistributedDataParallel, alone and with ZeRO-1; cp=2 × tp=2 loss and
gradients with selective recompute). The single-process references run inside each worker (one
thread each) on the full sequence (same seed, same data), so the workers return relative errors."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ndtrain.parallel.placement import placement_of
from ndtrain.bench import cp as bench_cp
from ndtrain.bench.harness import BenchOptions
from ndtrain.config import ParallelConfig, config_from_dict
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.models.llama import build_model
from ndtrain.parallel.model.context import (
    DEFAULT_TILE, Ring, apply_context_parallel, attention_work, balanced_chunks, ring_attention, shard_sequence,
)
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.model.recompute import SavedActivations, apply_recompute
from ndtrain.parallel.placement import is_tensor_parallel
from ndtrain.parallel.model.tp_plan import parallelize
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from tests.helpers.runner import init_method, run_distributed

TOL = 1e-5
SEED = 7
HEADS = ((4, 2), (3, 3), (6, 2))  # (query heads, kv heads): GQA, odd, GQA with 3 heads per kv head
CONSTANT_BYTES = 12  # saved for backward whatever the sequence length: cross-entropy's fp32 total weight and the int64 target count
TRAIN_STEPS = 4
LR = 1e-2
# AdamW's eps well above the smallest gradients keeps its update a smooth function of the gradient.
# With the default 1e-8, elements whose gradient is ~1e-8 (wq/wk gradients at init are ≤ 1e-4)
# turn fp32 summation-order differences (ring attention's block-wise softmax against SDPA's) of
# ~1e-7 into parameter differences of ~1e-4 after one step, whatever the layout code does; the
# first step's gradients are compared as well, at the same 1e-5.
ADAM_EPS = 1e-3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def tiny(**overrides: Any):
    return config_from_dict({"model": {"preset": "tiny", **overrides}}).model


def ring_errors(ctx: ParallelContext, seq: int) -> dict[str, float]:
    """Ring attention fwd+bwd on this rank's shard against full causal attention, per head layout,
    with whole blocks and with tiles of 5 (crossing the chunk boundaries and the diagonal)."""
    index = torch.arange(seq)[None]
    _, _, positions = shard_sequence(index, index, ctx)
    errors = {}
    for (heads, kv_heads), tile in itertools.product(HEADS, (DEFAULT_TILE, 5)):
        ring = Ring(ctx.comm, ctx.group("cp"), tile)
        gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
        q, k, v = (torch.randn(2, n, seq, 8, generator=gen, requires_grad=True) for n in (heads, kv_heads, kv_heads))
        grad = torch.randn(2, heads, seq, 8, generator=gen)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        local = [t.detach()[:, :, positions].requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, ring)
        grads = torch.autograd.grad(out, local, grad[:, :, positions])
        name = f"H{heads}K{kv_heads} tile {tile}"
        errors[f"{name} out"] = rel(out, ref[:, :, positions])
        for label, g, r in zip("qkv", grads, ref_grads):
            errors[f"{name} d{label}"] = rel(g, r[:, :, positions])
    return errors


def model_errors(ctx: ParallelContext, recompute: str, cp_first: bool, tp: bool = False) -> dict[str, float]:
    """The tiny Llama at cp (× tp): loss and gradients (averaged over cp; a tp rank's gradient
    shards) against the single-process model."""
    cfg = tiny()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = build_model(cfg, SEED)
    ref_loss = reference(inputs, targets)
    ref_loss.backward()
    model = parallelize(build_model(cfg, SEED), ctx) if tp else build_model(cfg, SEED)
    if cp_first:
        model = apply_recompute(apply_context_parallel(model, ctx), recompute)
    else:
        model = apply_context_parallel(apply_recompute(model, recompute), ctx)
    loss = model(*shard_sequence(inputs, targets, ctx))
    loss.backward()
    group = ctx.group("cp")
    flat = torch.cat([loss.detach().reshape(1)] + [p.grad.reshape(-1) for p in model.parameters()])
    ctx.comm.all_reduce(flat, group)
    flat /= group.size
    ref_grads = [_shard_of(ref.grad, p) for ref, p in zip(reference.parameters(), model.parameters(), strict=True)]
    ref_flat = torch.cat([ref_loss.detach().reshape(1)] + [g.reshape(-1) for g in ref_grads])
    return {"loss": rel(flat[:1], ref_flat[:1]), "grads": rel(flat[1:], ref_flat[1:])}


def _shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of `full` a tensor-parallel `param` holds (all of it for a replicated one)."""
    if not is_tensor_parallel(param):
        return full
    shard = placement_of(param).tp
    return full.narrow(shard.dim, shard.start, shard.length)


def saved_bytes(ctx: ParallelContext) -> tuple[int, int]:
    """Bytes saved for backward by the tiny Llama on the whole sequence, and by this rank at cp."""
    cfg = tiny(seq_len=64)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    reference = build_model(cfg, SEED)
    with SavedActivations(reference) as full:
        reference(inputs, targets)
    model = apply_context_parallel(build_model(cfg, SEED), ctx)
    with SavedActivations(model) as sharded:
        model(*shard_sequence(inputs, targets, ctx))
    return full.bytes, sharded.bytes


def two_ranks() -> dict[str, Any]:
    ctx = init(ParallelConfig(cp=2), init_method=init_method())
    result: dict[str, Any] = {"ring": ring_errors(ctx, 24)}  # chunks of 6: not a power of two
    for recompute in ("none", "selective", "full"):
        for cp_first in (True, False):
            result[f"model {recompute} cp_first={cp_first}"] = model_errors(ctx, recompute, cp_first)
    result["bytes"] = saved_bytes(ctx)
    result["positions"] = shard_sequence(torch.zeros(1, 8), torch.zeros(1, 8), ctx)[2].tolist()
    options = BenchOptions(steps=2, warmup=0, repeats=1, preset="tiny", seq_len=32, micro_batch=2)
    result["bench"] = bench_cp.run(ctx, options).to_json()
    return result


def four_ranks() -> dict[str, Any]:
    ctx = init(ParallelConfig(cp=4), init_method=init_method())
    result: dict[str, Any] = {"ring": ring_errors(ctx, 32), "bytes": saved_bytes(ctx)}
    result["positions"] = shard_sequence(torch.zeros(1, 16), torch.zeros(1, 16), ctx)[2].tolist()
    ctx = init(ParallelConfig(dp=2, cp=2), init_method=init_method())
    result["trained"] = train_dp_cp(ctx, zero=False)
    result["trained zero1"] = train_dp_cp(ctx, zero=True)
    ctx = init(ParallelConfig(cp=2, tp=2), init_method=init_method())
    result["cp_tp"] = model_errors(ctx, "selective", cp_first=False, tp=True)
    return result


def batches(cfg) -> torch.Tensor:
    """[steps, 4 sequences, seq_len + 1]: the global batch of every step."""
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, cfg.vocab_size, (TRAIN_STEPS, 4, cfg.seq_len + 1), generator=gen)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def train(model: torch.nn.Module, data: torch.Tensor, shard, optimizer=None) -> dict[str, torch.Tensor]:
    """TRAIN_STEPS AdamW steps; returns the gradients of the first."""
    optimizer = optimizer or adamw(model.parameters())
    first: dict[str, torch.Tensor] = {}
    for step in range(TRAIN_STEPS):
        model(*shard(data[step, :, :-1], data[step, :, 1:])).backward()
        first = first or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first


def train_dp_cp(ctx: ParallelContext, zero: bool) -> dict[str, float]:
    """dp=2 × cp=2 (with ZeRO-1 over dp×cp if `zero`): each dp rank trains on half the sequences,
    each cp rank on its shard of them; the single-process reference trains on all of them."""
    cfg = tiny()
    data = batches(cfg)
    per_dp = data.shape[1] // ctx.size("dp")
    mine = data[:, ctx.coord("dp") * per_dp : (ctx.coord("dp") + 1) * per_dp]
    model = DistributedDataParallel(apply_context_parallel(build_model(cfg, SEED), ctx), ctx)
    optimizer = ZeroOptimizer(model, ctx, adamw) if zero else None
    grads = train(model, mine, lambda x, y: shard_sequence(x, y, ctx), optimizer)
    reference = build_model(cfg, SEED)
    ref_grads = train(reference, data, lambda x, y: (x, y))
    expected = dict(reference.named_parameters())
    errors = {f"grad {n}": rel(grads[f"module.{n}"], g) for n, g in ref_grads.items()}
    errors.update({n: rel(p.detach(), expected[n].detach()) for n, p in model.module.named_parameters()})
    return errors


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(two_ranks, 2)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(four_ranks, 4)


def _assert_small(errors: dict[str, float]) -> None:
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def test_ring_attention_equals_full_attention_cp2(two: list[dict[str, Any]]) -> None:
    for rank in two:
        _assert_small(rank["ring"])


def test_ring_attention_equals_full_attention_cp4(four: list[dict[str, Any]]) -> None:
    for rank in four:
        _assert_small(rank["ring"])


def test_model_at_cp2_equals_single_process(two: list[dict[str, Any]]) -> None:
    for rank in two:
        for key, errors in rank.items():
            if key.startswith("model"):
                _assert_small({f"{key} {k}": v for k, v in errors.items()})


@pytest.mark.parametrize("run", ["trained", "trained zero1"])
def test_dp2_cp2_training_equals_single_process(four: list[dict[str, Any]], run: str) -> None:
    for rank in four:
        _assert_small(rank[run])


def test_cp2_tp2_model_equals_single_process(four: list[dict[str, Any]]) -> None:
    for rank in four:
        _assert_small(rank["cp_tp"])


def test_bench_counts_exactly_the_stated_bytes(two: list[dict[str, Any]]) -> None:
    """`bench cp`: counted wire bytes per step = K/V ring + dK/dV + gradient all-reduce, as stated."""
    data = two[0]["bench"]
    facts, summary = data["facts"], data["summary"]
    assert data["reference"] == "cp1" and set(summary) == {"cp1", "cp2"}
    assert summary["cp2"]["comm_bytes_per_step"] == facts["comm_bytes"] > facts["all_reduce_bytes"]
    assert summary["cp1"]["comm_bytes_per_step"] == 0
    assert facts["work_max_over_min"] == 1.0 and facts["contiguous_work_max_over_min"] == 2.0
    whole, shard = facts["cp1_saved_activation_bytes"], facts["cp2_saved_activation_bytes"]
    assert shard == (whole - CONSTANT_BYTES) // 2 + CONSTANT_BYTES


def test_load_balanced_layout() -> None:
    assert [balanced_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_positions_are_global(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    assert [r["positions"] for r in two] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [r["positions"] for r in four] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_attention_work_balanced(cp: int) -> None:
    """Score entries per rank: n = T/2c; every rank one causal 2n×2n block and c−1 rectangles of 2n²."""
    seq = 16 * cp
    n = seq // (2 * cp)
    balanced, contiguous = attention_work(seq, cp), attention_work(seq, cp, balanced=False)
    assert balanced == [4 * n * n + (cp - 1) * 2 * n * n] * cp
    assert max(balanced) / min(balanced) <= 1.1
    assert contiguous == [4 * n * n * (r + 1) for r in range(cp)]  # max/min = cp
    assert sum(balanced) == sum(contiguous)
    tiled = attention_work(seq, cp, tile=3)  # causal tiles wholly in the future are skipped
    assert max(tiled) == min(tiled) < max(balanced)


def test_saved_activations_per_rank_are_one_over_cp(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """Every saved tensor scales with the local tokens but two: cross-entropy's fp32 total weight and the
    int64 target count its sum is divided by, the stated constant of 12 bytes. So per rank, exactly:
    saved(cp) = (saved(1) − 12) / cp + 12."""
    for ranks, cp in ((two, 2), (four, 4)):
        for rank in ranks:
            full, sharded = rank["bytes"]
            assert sharded <= full / cp + CONSTANT_BYTES
            assert sharded == (full - CONSTANT_BYTES) // cp + CONSTANT_BYTES, (cp, full, sharded)


def test_sequence_not_divisible_by_two_cp() -> None:
    ctx = init(ParallelConfig())
    tokens = torch.zeros(1, 7, dtype=torch.long)
    with pytest.raises(UserError, match="not divisible by 2·cp = 2"):
        shard_sequence(tokens, tokens, ctx)
