"""Tensor and sequence parallelism against the unsharded reference (relative error ≤ 1e-5).

One spawn per world size runs every scenario: each parallel layer alone (forward output, input
and weight gradients), the whole tiny Llama at tp=2 and 4 with and without sequence parallelism
(loss, logits, every gradient, and the exact collectives of a step), and dp=2 × tp=2 training
with DDP and with ZeRO-1 against single-process AdamW with global-norm clipping. The layers and
models are checked in fp32; the training runs and their reference in float64 (`TRAIN_DTYPE`): in
fp32 the CPU kernels' summation order, amplified by AdamW on near-cancelling gradients, alone came
within 2× of the bound (tests/test_zero.py); in float64 that noise is ~1e-14.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ndtrain.dist.mesh
from ndtrain.parallel.placement import placement_of
from ndtrain.bench.tp import analytic_wire_bytes
from ndtrain.dist.comm import Group
from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.placement import is_tensor_parallel
from ndtrain.parallel.model.tensor import ColumnParallelLinear, RowParallelLinear
from ndtrain.parallel.model.tp_plan import parallelize, resolve_plan
from ndtrain.parallel.model.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from tests.helpers.models import fake_tp_ctx
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

TOL = 1e-5
# vocab 255: padded to 256 at tp=2 and 4; 4 heads, 2 kv heads: split at tp=2, replicated at tp=4.
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=255, seq_len=16)
BATCH, SEQ = 2, 16
TRAIN_DTYPE = torch.float64  # of the dp × tp training runs and their reference (see the docstring)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full tensor a sharded parameter holds (padding beyond `full` as zeros)."""
    s = placement_of(param).tp
    if s.full > full.shape[s.dim]:
        pad = full.new_zeros((*full.shape[: s.dim], s.full - full.shape[s.dim], *full.shape[s.dim + 1 :]))
        full = torch.cat([full, pad], dim=s.dim)
    return full.narrow(s.dim, s.start, s.length)


def seq_part(x: torch.Tensor, group: Group) -> torch.Tensor:
    t = x.shape[1] // group.size
    return x[:, group.rank * t : (group.rank + 1) * t]


# --------------------------------------------------------------------------- layers
def _check_layers(ctx: ParallelContext) -> None:
    group, comm = ctx.group("tp"), ctx.comm
    n, r = group.size, group.rank
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, 24)
    for sp in (False, True):
        for bias in (False, True):
            full = nn.Linear(24, 16, bias=bias)
            dy = torch.randn(BATCH, SEQ, 16)
            xr = x.clone().requires_grad_()
            (full(xr) * dy).sum().backward()
            # column-parallel, output gathered
            col = ColumnParallelLinear(full, comm, group, sequence_parallel=sp, gather_output=True)
            xi = (seq_part(x, group) if sp else x).clone().requires_grad_()
            y = col(xi)
            close(y, full(x).detach(), f"column sp={sp} bias={bias} output")
            (y * dy).sum().backward()
            close(xi.grad, seq_part(xr.grad, group) if sp else xr.grad, f"column sp={sp} input grad")
            close(col.weight.grad, shard_of(full.weight.grad, col.weight), f"column sp={sp} weight grad")
            if bias:
                close(col.bias.grad, shard_of(full.bias.grad, col.bias), "column bias grad")
            # row-parallel, fed this rank's input features
            full2 = nn.Linear(24, 16, bias=bias)
            xr2 = x.clone().requires_grad_()
            (full2(xr2) * dy).sum().backward()
            row = RowParallelLinear(full2, comm, group, sequence_parallel=sp)
            k = 24 // n
            xi2 = x[..., r * k : (r + 1) * k].clone().requires_grad_()
            y2 = row(xi2)
            close(y2, seq_part(full2(x).detach(), group) if sp else full2(x).detach(), f"row sp={sp} output")
            (y2 * (seq_part(dy, group) if sp else dy)).sum().backward()
            close(xi2.grad, xr2.grad[..., r * k : (r + 1) * k], f"row sp={sp} input grad")
            close(row.weight.grad, shard_of(full2.weight.grad, row.weight), f"row sp={sp} weight grad")
            if bias:
                grad = row.bias.grad.clone()
                if sp:  # a sequence shard's bias gradient is partial (parallelize hooks a sum over tp)
                    comm.all_reduce(grad, group)
                close(grad, full2.bias.grad, f"row sp={sp} bias grad")
        # vocabulary-parallel embedding (13 rows: padded at tp=2 and 4)
        emb = nn.Embedding(13, 8)
        tokens = torch.randint(0, 13, (BATCH, SEQ))
        dz = torch.randn(BATCH, SEQ, 8)
        (emb(tokens) * dz).sum().backward()
        vemb = VocabParallelEmbedding(emb, comm, group, sequence_parallel=sp)
        z = vemb(tokens)
        close(z, seq_part(emb(tokens), group).detach() if sp else emb(tokens).detach(), f"embedding sp={sp} output")
        (z * (seq_part(dz, group) if sp else dz)).sum().backward()
        close(vemb.weight.grad, shard_of(emb.weight.grad, vemb.weight), f"embedding sp={sp} weight grad")
    # vocabulary-parallel cross-entropy on logit columns, padding masked
    logits = torch.randn(BATCH, SEQ, 13, requires_grad=True)
    targets = torch.randint(0, 13, (BATCH, SEQ))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    width = -(-13 // n)
    mine = torch.cat([logits.detach(), torch.randn(BATCH, SEQ, width * n - 13)], dim=-1)  # junk padding
    mine = mine[..., r * width : (r + 1) * width].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(mine, targets, r * width, 13, comm, group)
    close(got, loss.detach(), "cross-entropy loss")
    got.backward()
    real = max(0, min(width, 13 - r * width))
    close(mine.grad[..., :real], logits.grad[..., r * width : r * width + real], "cross-entropy grad")
    if real < width:
        assert mine.grad[..., real:].abs().max().item() == 0, "padding columns got a gradient"


# --------------------------------------------------------------------------- whole model
def _expected_comm(cfg: ModelConfig, n: int, sp: bool) -> dict[str, tuple[int, int]]:
    """op/tp → (calls, payload bytes) of one forward + backward, analytically (fp32)."""
    layers, tokens, x = cfg.n_layers, BATCH * SEQ, BATCH * SEQ * cfg.dim * 4
    head = cfg.dim // cfg.n_heads
    kv = (2 * layers, 2 * layers * cfg.n_kv_heads * head * cfg.dim * 4) if cfg.n_kv_heads % n else (0, 0)
    loss = (2, 3 * tokens * 4)  # max of the logits, then Σexp and the target logit
    if not sp:  # per layer f/g of attention and MLP, forward and backward; the embedding's g; the head's f
        return {"all_reduce/tp": (4 * layers + 2 + loss[0] + kv[0], (4 * layers + 2) * x + loss[1] + kv[1])}
    moves = (4 * layers + 2, (4 * layers + 2) * x)
    norms = (2 * layers + 1, (2 * layers + 1) * cfg.dim * 4)
    return {"all_gather/tp": moves, "reduce_scatter/tp": moves,
            "all_reduce/tp": (loss[0] + norms[0] + kv[0], loss[1] + norms[1] + kv[1])}


def _check_model(ctx: ParallelContext, cfg: ModelConfig, sp: bool) -> None:
    group = ctx.group("tp")
    reference = build_model(cfg, seed=3)
    model = parallelize(build_model(cfg, seed=3), ctx, sequence_parallel=sp)
    torch.manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    want = reference(x, y)
    want.backward()
    before = ctx.comm.stats.snapshot()
    got = model(x, y)
    got.backward()
    after = ctx.comm.stats.snapshot()
    what = f"tp={group.size} sp={sp} kv={cfg.n_kv_heads} tied={cfg.tie_embeddings}"
    close(got.detach(), want.detach(), f"{what} loss")
    counts = {k: (v["calls"] - before.get(k, {}).get("calls", 0),
                  v["payload_bytes"] - before.get(k, {}).get("payload_bytes", 0)) for k, v in after.items()}
    counts = {k: v for k, v in counts.items() if v[0]}
    assert counts == _expected_comm(cfg, group.size, sp), f"{what} comm {counts}"
    wire = sum(v["wire_bytes"] - before.get(k, {}).get("wire_bytes", 0) for k, v in after.items())
    assert wire == analytic_wire_bytes(cfg, BATCH * SEQ, group.size, sp), f"{what} wire bytes {wire}"
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref = ref_params[name]
        if is_tensor_parallel(param):
            close(param.detach(), shard_of(ref.detach(), param), f"{what} {name} initial shard")
            close(param.grad, shard_of(ref.grad, param), f"{what} {name} grad")
        else:
            close(param.detach(), ref.detach(), f"{what} {name} initial")
            close(param.grad, ref.grad, f"{what} {name} grad")
    with torch.no_grad():
        close(model(x), reference(x), f"{what} logits")


# --------------------------------------------------------------------------- dp × tp training
def _clip(params: list[nn.Parameter], ctx: ParallelContext | None, max_norm: float) -> float:
    """The engine's global norm: sharded squares summed over tp, replicated ones counted once."""
    zero = torch.zeros((), dtype=params[0].grad.dtype)
    sharded = sum((p.grad.pow(2).sum() for p in params if is_tensor_parallel(p)), zero)
    replicated = sum((p.grad.pow(2).sum() for p in params if not is_tensor_parallel(p)), zero)
    if ctx is not None:
        ctx.comm.all_reduce(sharded, ctx.group("tp"))
    norm = (sharded + replicated).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([p.grad for p in params], scale)
    return norm.item()


def _check_training(ctx: ParallelContext, zero: bool, sp: bool, micro: int) -> None:
    """`micro` micro-batches per rank and step, gradients accumulated under `no_sync` but the last."""
    steps, clip = 3, 0.05  # a small max norm, so every step is clipped
    reference = build_model(CFG, seed=5).to(TRAIN_DTYPE)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    model = parallelize(build_model(CFG, seed=5).to(TRAIN_DTYPE), ctx, sequence_parallel=sp)
    wrapped = DistributedDataParallel(model, ctx)
    make = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt = ZeroOptimizer(wrapped, ctx, make) if zero else make(model.parameters())
    dp, dp_rank = ctx.group("dp_cp").size, ctx.group("dp_cp").rank
    gen = torch.Generator().manual_seed(17)
    for step in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH * dp, SEQ + 1), generator=gen)
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        ref_norm = _clip(list(reference.parameters()), None, clip)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = tokens[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        for i, part in enumerate(mine.chunk(micro)):
            with wrapped.no_sync() if i < micro - 1 else contextlib.nullcontext():
                (wrapped(part[:, :-1], part[:, 1:]) / micro).backward()
        norm = _clip(list(model.parameters()), ctx, clip)
        assert abs(norm - ref_norm) <= TOL * ref_norm, f"step {step} grad norm {norm} != {ref_norm}"
        opt.step()
        wrapped.zero_grad()
    ref_params = dict(reference.named_parameters())
    got = {name: param.detach() for name, param in model.named_parameters()}
    want = {name: shard_of(ref_params[name].detach(), p) if is_tensor_parallel(p) else ref_params[name].detach()
            for name, p in model.named_parameters()}
    assert {t.dtype for t in got.values()} == {TRAIN_DTYPE}
    assert_params_close(got, want, TOL, f"dp={dp} tp zero={zero} sp={sp} micro={micro} after {steps} steps")


# --------------------------------------------------------------------------- workers
def _suite(tp: int, dp: int) -> bool:
    ctx = ndtrain.dist.mesh.init(ParallelConfig(dp=dp, tp=tp, backend="gloo", device="cpu"), init_method=init_method())
    if dp == 1:
        _check_layers(ctx)
        for sp in (False, True):
            _check_model(ctx, CFG, sp)
        _check_model(ctx, replace(CFG, tie_embeddings=True, n_kv_heads=4), True)
    else:
        _check_training(ctx, zero=False, sp=False, micro=1)
        _check_training(ctx, zero=True, sp=True, micro=2)
    return True


def test_tp2_layers_and_model_match_single_process() -> None:
    assert run_distributed(_suite, 2, 2, 1) == [True, True]


def test_tp4_layers_and_model_match_single_process() -> None:
    assert run_distributed(_suite, 4, 4, 1) == [True] * 4


def test_dp2_tp2_training_with_ddp_and_zero1_matches_single_process() -> None:
    assert run_distributed(_suite, 4, 2, 2) == [True] * 4


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("cfg", "tp", "message"), [
    (replace(CFG, n_heads=4, n_kv_heads=4), 8, "n_heads=4 is not divisible by tp=8"),
    (replace(CFG, dim=48, n_heads=6, n_kv_heads=6, ffn_dim=96), 4, "n_heads=6"),
    (replace(CFG, n_heads=6, dim=48, n_kv_heads=3, ffn_dim=96), 2, "n_kv_heads=3"),
    (replace(CFG, ffn_dim=66), 4, "'layers.0.feed_forward.w1' has 66 output features"),
])
def test_sizes_that_do_not_divide_are_clear_errors(cfg: ModelConfig, tp: int, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parallelize(build_model(cfg, seed=0), fake_tp_ctx(tp))


def test_bad_plans_are_clear_errors() -> None:
    model = build_model(CFG, seed=0)
    with pytest.raises(UserError, match="matches no module"):
        resolve_plan(model, {"layers.*.attention.wqq": "colwise"}, 2)
    with pytest.raises(UserError, match="RMSNorm, but colwise"):
        resolve_plan(model, {"norm": "colwise"}, 2)
    with pytest.raises(UserError, match="unknown style"):
        resolve_plan(model, {"norm": "diagonal"}, 2)
    with pytest.raises(UserError, match="two styles"):
        resolve_plan(model, {"layers.*.attention.w*": "colwise", "layers.*.attention.wo": "rowwise"}, 2)
    with pytest.raises(UserError, match="pass a plan"):
        parallelize(nn.Sequential(nn.Linear(4, 4)), fake_tp_ctx(2))


def test_generic_plan_slices_the_full_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
    full = copy.deepcopy(model)
    parallelize(model, fake_tp_ctx(2), {"0": "vocab", "1.0": "colwise", "1.2": "rowwise"})
    assert torch.equal(model[1][0].weight, full[1][0].weight[:8])
    assert torch.equal(model[1][2].weight, full[1][2].weight[:, :8])
    assert torch.equal(model[0].weight, full[0].weight[:5])
    assert not is_tensor_parallel(model[1][2].bias) and is_tensor_parallel(model[1][0].bias)
