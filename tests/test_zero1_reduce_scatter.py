"""ZeRO-1 on reduce-scatter, through the Engine: parity with one process and the exact traffic.

One spawn of 4 processes trains, with clipping and 2 micro-batches per step (accumulated locally
under `no_sync`, in full gradients):
- dp=4, float64, through the shared-memory ring (the default on one host, dist/host_stream.py; each
  bucket here fits one round): parameters equal the single-process run (relative error ≤ 1e-5);
  every step reduce-scatters every bucket once (not once per micro-batch): exactly (N−1)/N·8Ψ'
  counted (Ψ' the buckets padded to a multiple of N), then gathers the parameters through the
  same ring, (N−1)/N·8Ψ' again: 2(N−1)/N·8Ψ' in all;
  no gradient is all-reduced (the norm's and the loss's scalars only), nothing else is sent;
- the same through gloo (`host_shared_memory=false`): the same reduce-scatter volume, the
  parameters gathered by N broadcasts per bucket;
- dp=2 × pp=2 with a tied embedding/head, float64: the tied weight's bucket is all-reduced whole
  through the backend (the runner sums the two copies), the others reduce-scattered through the
  shared-memory ring: parity again;
- dp=4, bf16 compute copies with fp32 masters: the loss curve and norms within bf16's rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.buckets import MB, pack
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from tests.helpers.counts import counted_since
from tests.helpers.layouts import BF16_LOSS_TOLERANCE, DTYPE, MAX_NORM, MODEL, STEPS, State, adamw, batch
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

BUCKET_MB = 0.01  # several buckets, sizes not divisible by 4
TIED = dataclasses.replace(MODEL, tie_embeddings=True)
CASES: dict[str, dict[str, Any]] = {
    "dp4": dict(dp=4, zero=1),
    "dp4-gloo": dict(dp=4, zero=1, host_shared_memory=False),
    "dp2-pp2-tied": dict(dp=2, pp=2, pp_schedule="1f1b", zero=1),
    "dp4-bf16": dict(dp=4, zero=1, precision="bf16"),
}
pytestmark = pytest.mark.usefixtures("one_thread")


def _train(name: str, layout: dict[str, Any]) -> dict[str, Any]:
    parallel = ParallelConfig(bucket_mb=BUCKET_MB, **layout)
    ctx = init(parallel, init_method=init_method())
    config = TIED if "tied" in name else MODEL
    dtype = torch.float32 if "bf16" in name else DTYPE
    engine = Engine(lambda: build_model(config, seed=0).to(dtype), adamw, ctx, parallel, group_fn=no_decay_for_vectors,
                    grad_clip=MAX_NORM)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    losses, norms, deltas = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        before = ctx.comm.stats.snapshot()
        result = engine.train_step(list(zip(x.chunk(2), y.chunk(2))))
        after = ctx.comm.stats.snapshot()
        deltas.append(counted_since(before, after))
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return {"losses": losses, "norms": norms, "deltas": deltas, "state": engine.full_state_dict()}


def _suite() -> dict[str, Any]:
    return {name: _train(name, layout) for name, layout in CASES.items()}


def reference(tied: bool) -> tuple[State, list[float], list[float]]:
    """The single-process float64 run on the whole batch: parameters, losses, norms before clipping."""
    model = build_model(TIED if tied else MODEL, seed=0).to(DTYPE)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = adamw(groups)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def padded_buckets(world: int, dtype: torch.dtype = DTYPE) -> list[int]:
    """From first principles: DDP's buckets (trainable parameters in reverse order, bucket cap in
    bytes of `dtype`), each padded to a multiple of N."""
    params = [p for p in build_model(MODEL, seed=0).to(dtype).parameters()][::-1]
    return [-(-sum(params[i].numel() for i in run) // world) * world for run in pack(params, int(BUCKET_MB * MB))]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_suite, 4, timeout=300)


def test_zero1_reduce_scatters_once_per_step_and_matches_one_process(results: list[dict[str, Any]]) -> None:
    state, losses, norms = reference(tied=False)
    padded, n, e = padded_buckets(4), 4, DTYPE.itemsize  # the fp32 comm dtype reduces float64 in float64
    ring = sum((n - 1) * e * p // n for p in padded)
    for rank, result in enumerate(results):
        run = result["dp4"]
        assert_params_close(run["state"], state, 1e-5, f"dp4 rank {rank}")
        assert run["losses"] == pytest.approx(losses, rel=1e-5)
        assert run["norms"] == pytest.approx(norms, rel=1e-5)
        for delta in run["deltas"]:
            # (N−1)/N·8Ψ' reduce-scattered, once per step although 2 micro-batches ran, then as much gathered
            bucket_ops = {"calls": len(padded), "payload_bytes": e * sum(padded), "wire_bytes": ring}
            assert delta["reduce_scatter_shm/dp_cp"] == bucket_ops
            assert delta["all_gather_shm/dp_cp"] == bucket_ops
            # the target count (8 bytes), the norm (e) and the loss with the token count (16 bytes): no gradient
            assert delta["all_reduce/dp_cp"]["payload_bytes"] == 8 + e + 16
            assert set(delta) == {"reduce_scatter_shm/dp_cp", "all_gather_shm/dp_cp", "all_reduce/dp_cp"}


def test_zero1_through_gloo_reduce_scatters_and_broadcasts(results: list[dict[str, Any]]) -> None:
    state, losses, norms = reference(tied=False)
    padded, n, e = padded_buckets(4), 4, DTYPE.itemsize
    ring = sum((n - 1) * e * p // n for p in padded)
    for rank, result in enumerate(results):
        run = result["dp4-gloo"]
        assert_params_close(run["state"], state, 1e-5, f"dp4-gloo rank {rank}")
        assert run["losses"] == pytest.approx(losses, rel=1e-5)
        for delta in run["deltas"]:
            assert delta["reduce_scatter/dp_cp"] == {"calls": len(padded), "payload_bytes": e * sum(padded), "wire_bytes": ring}
            # gloo: the parameters gathered by N broadcasts per bucket (ctx.comm counts each once, at its root)
            assert delta["broadcast/dp_cp"] == {"calls": n * len(padded), "payload_bytes": e * sum(padded),
                                                "wire_bytes": e * sum(padded) // n}
            assert "all_gather/dp_cp" not in delta
            # the target count (8 bytes), the norm (e) and the loss with the token count (16 bytes): no gradient
            assert delta["all_reduce/dp_cp"]["payload_bytes"] == 8 + e + 16


def test_zero1_with_a_pipeline_tied_weight_matches_one_process(results: list[dict[str, Any]]) -> None:
    state, losses, norms = reference(tied=True)
    merged: State = {}
    for result in results:
        run = result["dp2-pp2-tied"]
        assert run["losses"] == pytest.approx(losses, rel=1e-5)
        assert run["norms"] == pytest.approx(norms, rel=1e-5)
        # the tied weight's bucket all-reduced whole through the backend (more than the loss's and the
        # norm's scalars), the others reduce-scattered through the shared-memory ring
        assert all(d["reduce_scatter_shm/dp_cp"]["calls"] >= 1 and d["all_reduce/dp_cp"]["payload_bytes"] > 2 * DTYPE.itemsize
                   for d in run["deltas"])
        merged.update(run["state"])
    assert merged.keys() == state.keys()
    assert_params_close(merged, state, 1e-5, "dp2-pp2-tied")


def test_zero1_with_bf16_compute_copies_follows_the_fp32_curve(results: list[dict[str, Any]]) -> None:
    _, losses, norms = reference(tied=False)
    for result in results:
        run = result["dp4-bf16"]
        assert run["losses"] != losses  # really in bf16
        assert run["losses"] == pytest.approx(losses, rel=BF16_LOSS_TOLERANCE)
        assert run["norms"] == pytest.approx(norms, rel=BF16_LOSS_TOLERANCE)
        assert all(d["reduce_scatter/dp_cp"]["calls"] == len(padded_buckets(4, torch.bfloat16)) for d in run["deltas"])
