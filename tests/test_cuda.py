"""What must hold on one CUDA device (marker `cuda`: skipped without one; `--cuda-dry-run` runs the same
logic on CPU with gloo, so it is debugged before a GPU is lent; `make gpu-check` runs it on the GPU).

At world size 1 every ndtrain collective is a no-op (a group of one rank communicates nothing,
dist/comm.py), so the strategies' runs here prove their device code — buckets, flat layouts, shards,
fp32 masters, hooks, recompute, the loss scaler — on CUDA, and `test_backend_collectives_on_device`
proves the backend's collectives (NCCL) on device tensors. What needs two ranks is run as both
ranks' halves in one process where the strategy allows it: the pipeline as two stage chunks of one
rank (the interleaved runner hands activations over locally), context parallel as the ring's blocks
of both ranks computed in turn (each kernel). Tensor parallel needs its f/g all-reduces between two
ranks, and NCCL refuses two ranks on one GPU: it is not run here (docs/gpu.md).

Bounds. float64 on the device against float64 on the CPU: the same arithmetic up to the kernels'
summation order, 1e-9 relative on every parameter after the steps. A rotary table computed in
float32 breaks that premise (CUDA's float32 cos differs from the CPU's in the last bit: 1.5e-6 on
the first GPU run), so our Llama computes its table in float64 for a float64 model, and the HF
Llama here is given a float64 table (`hf_llama_wide_rotary`). fp32: the summation order's
last-bit differences (≈1e-7) are amplified by AdamW's first steps (an update ≈ lr·sign(g) where g is
tiny), the reason the CPU parity tests train in float64 (README "Tests"); 2e-3 relative per tensor
after 4 steps at lr 1e-3 and losses within 1e-4 relative. bf16 tracks fp32: every step's loss
within 2% of the fp32 run's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndtrain.config import ParallelConfig
from ndtrain.dist import mesh
from ndtrain.checkpoint.safe_pickle import load_tensors
from ndtrain.checkpoint.store import load_checkpoint, save_checkpoint
from ndtrain.engine import Engine
from ndtrain.parallel.model.attention_blocks import fused_backward, fused_forward, tile_backward, tile_forward
from ndtrain.parallel.model.context import balanced_chunks, block_plan
from ndtrain.parallel.pipeline import run_pipeline
from ndtrain.parallel.pipeline.partition import split_model
from tests.helpers.models import adamw, batch, make_llama, shard
from tests.helpers.parity import assert_params_close

pytestmark = pytest.mark.cuda

STEPS = 4
F64_TOL = 1e-9
FP32_TOL = 2e-3
FP32_LOSS_TOL = 1e-4
BF16_LOSS_TOL = 0.02


@pytest.fixture(scope="module")
def device() -> str:
    """"cuda" where a GPU is visible, else "cpu" (a `--cuda-dry-run`: the same logic on CPU)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def train(device: str, model_fn: Callable[[], torch.nn.Module], steps: int = STEPS, accumulation: int = 2,
          **parallel: Any) -> tuple[list[float], dict[str, torch.Tensor], Engine]:
    """`steps` engine steps at world size 1 on `device`: the losses, the weights (on the CPU), the engine."""
    cfg = ParallelConfig(device=device, **parallel)
    ctx = mesh.init(cfg)
    engine = Engine(model_fn, adamw, ctx, cfg, grad_clip=1.0)
    losses = [engine.train_step(shard(batch(step), 0, 1, accumulation)).loss for step in range(steps)]
    return losses, {k: v.cpu() for k, v in engine.full_state_dict().items()}, engine


def float64_llama() -> torch.nn.Module:
    return make_llama(torch.float64)


# ------------------------------------------------------------------------------------ the backend on the device
def test_backend_collectives_on_device(device: str, tmp_path: Path) -> None:
    """NCCL (gloo in a dry run) initialises at world size 1 and reduces, gathers and scatters device tensors."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.arange(8, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        gathered = torch.empty(8, device=device)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, t)  # renamed in torch 2.13
        part = torch.empty(8, device=device)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, gathered)
        assert part.device.type == device and torch.equal(part.cpu(), torch.arange(8, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ the device against the CPU
def test_builtin_model_float64_equals_cpu(device: str) -> None:
    _, on_device, _ = train(device, float64_llama)
    _, on_cpu, _ = train("cpu", float64_llama)
    assert_params_close(on_device, on_cpu, F64_TOL, f"tiny Llama float64 on {device} vs cpu")


def test_builtin_model_fp32_close_to_cpu(device: str) -> None:
    losses, on_device, _ = train(device, make_llama)
    cpu_losses, on_cpu, _ = train("cpu", make_llama)
    assert_params_close(on_device, on_cpu, FP32_TOL, f"tiny Llama fp32 on {device} vs cpu")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses))
    assert worst <= FP32_LOSS_TOL, f"fp32 losses on {device} {losses} vs cpu {cpu_losses}"


def hf_llama_wide_rotary() -> torch.nn.Module:
    """The tiny HF Llama in float64 with its rotary table computed in float64: transformers computes
    it in float32 whatever the model's dtype, and CUDA's float32 cos/sin differ from the CPU's in the
    last bit, which AdamW's first steps amplify to ~1e-6 (first GPU run, 2026-11-28: our own Llama's
    float32 table gave 1.5e-6 on the H100; on CPU, nudging that table by one ulp gives 2.7e-6). The
    comparison is of ndtrain's device code, so the table is made exact on both sides."""
    from tests.helpers.hf import make_model

    model = make_model("llama")
    rotary = model.hf.model.rotary_emb

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].to(torch.float64) * rotary.inv_freq.to(x.device, torch.float64)
        angles = torch.cat((freqs, freqs), dim=-1)
        return ((angles.cos() * rotary.attention_scaling).to(x.dtype),
                (angles.sin() * rotary.attention_scaling).to(x.dtype))

    rotary.forward = forward
    return model


def test_hf_model_float64_equals_cpu(device: str) -> None:
    pytest.importorskip("transformers")  # may be missing on a GPU machine
    _, on_device, _ = train(device, hf_llama_wide_rotary)
    _, on_cpu, _ = train("cpu", hf_llama_wide_rotary)
    assert_params_close(on_device, on_cpu, F64_TOL, f"HF Llama float64 on {device} vs cpu")


def test_bf16_tracks_fp32(device: str) -> None:
    fp32, _, _ = train(device, make_llama, steps=8)
    bf16, _, engine = train(device, make_llama, steps=8, precision="bf16")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    worst = max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32))
    assert worst <= BF16_LOSS_TOL, f"bf16 losses {bf16} vs fp32 {fp32}"


# ------------------------------------------------------------------------------------ every strategy's device code
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "ddp-levers": {"flat_adamw": True, "reorder_buckets": True},
    "zero1": {"zero": 1},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "recompute-full": {"recompute": "full"},
    "recompute-selective": {"recompute": "selective"},
}


@pytest.fixture(scope="module")
def float64_reference() -> dict[str, torch.Tensor]:
    return train("cpu", float64_llama)[1]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_float64_equals_cpu(device: str, name: str, float64_reference: dict[str, torch.Tensor]) -> None:
    _, on_device, _ = train(device, float64_llama, **STRATEGIES[name])
    assert_params_close(on_device, float64_reference, F64_TOL, f"{name} on {device} vs plain cpu")


@pytest.mark.parametrize("precision,zero", [("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3), ("fp16", 0)])
def test_mixed_precision_tracks_fp32(device: str, precision: str, zero: int) -> None:
    """16-bit compute with fp32 masters (fp16 with its loss scaler) follows the fp32 run's losses."""
    if device == "cpu" and precision == "fp16":
        pytest.skip("fp16 matmuls on CPU are not what this checks (dry run)")
    fp32, _, _ = train(device, make_llama, steps=6)
    mixed, _, engine = train(device, make_llama, steps=6, precision=precision, zero=zero)
    assert engine.skipped_steps <= 1, "the loss scaler skipped more than its first overflow"
    worst = max(abs(a - b) / abs(b) for a, b in zip(mixed, fp32))
    assert worst <= BF16_LOSS_TOL, f"{precision} zero={zero} losses {mixed} vs fp32 {fp32}"


def test_two_stage_pipeline_in_one_process(device: str) -> None:
    """Both stages of a 2-stage pipeline as two chunks of one rank: the runner's schedule, hand-over and
    backward on the device give the unsplit model's gradients."""
    ctx = mesh.init(ParallelConfig(device=device))
    whole = float64_llama().to(device)
    stages = [s.to(device) for s in split_model(float64_llama().to(device), ctx, virtual=2)]
    micro = [(x.to(device), y.to(device)) for x, y in shard(batch(0), 0, 1, 2)]
    loss_sum, _ = run_pipeline(stages, micro, ctx, "interleaved")
    expected = sum(whole(x, y) for x, y in micro)
    (expected / len(micro)).backward()
    assert math.isclose(loss_sum.item(), expected.item(), rel_tol=1e-6)  # the runner sums losses in fp32
    grads = {n: p.grad for s in stages for n, p in s.named_parameters() if p.grad is not None}
    reference = dict(whole.named_parameters())
    for name, grad in grads.items():
        want = reference[name.removeprefix("module.")].grad
        assert torch.allclose(grad, want, rtol=1e-9, atol=1e-12), name


# ------------------------------------------------------------------------------------ context parallel, both ranks
def _ring_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, fused: bool,
                  dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Causal attention of the whole sequence computed as cp ranks' ring blocks, rank after rank, with
    the ring's own block functions: the output and dq, dk, dv (whole sequence, positions in order)."""
    seq = q.shape[2]
    n = seq // (2 * cp)
    idx = [torch.cat([torch.arange(c * n, (c + 1) * n) for c in balanced_chunks(r, cp)]) for r in range(cp)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, q, k, k))
    groups = q.shape[1] // k.shape[1]
    for r in range(cp):
        ql = q[..., idx[r], :].contiguous()
        o = torch.zeros(ql.shape if fused else (ql.shape[0], k.shape[1], groups, *ql.shape[2:]), device=q.device)
        lse = torch.full(o.shape[:-1], float("-inf"), device=q.device)
        qb = ql if fused else ql.unflatten(1, (k.shape[1], groups))
        plans = []
        for t in range(cp):
            j = (r - t) % cp
            kv = torch.stack((k[..., idx[j], :], v[..., idx[j], :])).contiguous()
            block = block_plan(balanced_chunks(r, cp), balanced_chunks(j, cp), n)
            if block is None:
                continue
            extra = fused_forward(ql, kv, block, scale, o, lse) if fused else None
            if not fused:
                for tile in block.tiles(64):
                    tile_forward(qb, kv, tile, scale, o, lse)
            plans.append((j, kv, block, extra))
        result = o.to(q.dtype).reshape(ql.shape)
        out[..., idx[r], :] = result.float()
        dl = dout[..., idx[r], :].contiguous()
        dql = torch.zeros(qb.shape, device=q.device)
        if not fused:
            dlb = dl.float().unflatten(1, (k.shape[1], groups))
            delta = (dlb * result.float().unflatten(1, (k.shape[1], groups))).sum(-1)
        for j, kv, block, extra in plans:
            dkv = torch.zeros(kv.shape, device=q.device)
            if fused:
                fused_backward(ql, kv, dl, result, lse, block, scale, extra, dql, dkv)
            else:
                for tile in block.tiles(64):
                    tile_backward(qb, kv, dlb, lse, delta, tile, scale, dql, dkv)
            dk[..., idx[j], :] += dkv[0]
            dv[..., idx[j], :] += dkv[1]
        dq[..., idx[r], :] = dql.reshape(ql.shape)
    return out, dq, dk, dv


@pytest.mark.parametrize("kernel", ["fused", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_two_ranks_in_one_process(device: str, kernel: str, dtype: torch.dtype) -> None:
    """cp = 2: both ranks' blocks (fused: SDPA's flash kernel and its log-sum-exp; tiles: ours) equal
    SDPA's causal attention over the whole sequence, forward and backward."""
    if kernel == "fused" and device == "cuda" and dtype == torch.float32:
        pytest.skip("the flash kernel takes bf16/fp16 on CUDA; fp32 rings use tiles there")
    gen = torch.Generator().manual_seed(0)
    B, H, K, T, h = 2, 8, 2, 256, 64
    q, k, v = (torch.randn(B, heads, T, h, generator=gen).to(device, dtype) for heads in (H, K, K))
    dout = torch.randn(B, H, T, h, generator=gen).to(device, dtype)
    leaves = [t.detach().clone().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(H // K, 1) for t in leaves[1:]), is_causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    got = _ring_by_hand(q, k, v, 2, kernel == "fused", dout)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


# ------------------------------------------------------------------------------------ checkpoints across devices
def _state(engine: Engine) -> dict[str, torch.Tensor]:
    """Weights and optimizer state, on the CPU, keyed by name (the state by group and position)."""
    state = {f"w.{k}": v.detach().cpu() for k, v in engine.full_state_dict().items()}
    for g, group in enumerate(engine.optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in engine.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"opt.{g}.{i}.{key}"] = value.detach().cpu()
    return state


@pytest.mark.parametrize("zero", [0, 3])
def test_checkpoint_device_to_cpu_and_back_bit_exact(device: str, zero: int, tmp_path: Path) -> None:
    """Saved on the device, loaded on the CPU: weights and optimizer state bit for bit; saved again
    there and loaded on the device: bit for bit again; both continue alike (fp32 bound)."""
    _, _, trained = train(device, make_llama, steps=2, zero=zero)
    trained.save(tmp_path / "a")
    _, _, on_cpu = train("cpu", make_llama, steps=0, zero=zero)
    on_cpu.load(tmp_path / "a")
    want = _state(trained)
    got = _state(on_cpu)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} changed from {device} to cpu"
    on_cpu.save(tmp_path / "b")
    _, _, back = train(device, make_llama, steps=0, zero=zero)
    back.load(tmp_path / "b")
    for name, value in _state(back).items():
        assert torch.equal(value, want[name]), f"{name} changed from cpu back to {device}"
    step = shard(batch(2), 0, 1, 2)
    assert math.isclose(back.train_step(step).loss, on_cpu.train_step(step).loss, rel_tol=FP32_LOSS_TOL)


def test_checkpoint_restores_this_devices_generator(device: str, tmp_path: Path) -> None:
    """A checkpoint holds the CPU generator and this rank's device's (not every visible GPU's): after a
    load, both draw what they drew after the save."""
    _, _, engine = train(device, make_llama, steps=1)
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 1, engine, {}, keep=1)
    want = torch.rand(4), torch.rand(4, device=device)
    torch.manual_seed(9)
    load_checkpoint(path, engine)
    got = torch.rand(4), torch.rand(4, device=device)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if device == "cuda":
        saved = load_tensors(path / "rng" / "rank00000.pt")
        assert isinstance(saved["cuda"], torch.Tensor)  # one device's state, not a list


@pytest.fixture(autouse=True)
def _no_process_group() -> Iterator[None]:
    """Each test starts and ends without a process group (world size 1 needs none)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()

