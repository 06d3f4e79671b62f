"""The planner on a calibrated CPU profile: reading it (threads, slots, per-op fits, layer pieces) and
the step time built from measured pieces, ndtrain's own collectives and processes sharing cores —
each against a value computed by hand from a synthetic profile (tests/plan_profiles.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndtrain.errors import UserError
from ndtrain.parallel.pipeline.schedules import Action, compute_actions
from ndtrain.plan import arch, collectives
from ndtrain.plan.cpu_pipeline import Slots, Work, makespan
from ndtrain.plan.cpu_profile import load_profile
from ndtrain.plan.hardware import Cluster, Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import stage_params
from ndtrain.plan.timing import step_time
from tests.plan_profiles import bench_pieces, cpu_profile

BENCH = arch.PRESETS["ndtrain-bench"]
B = 8


def hardware(tmp_path: Path, processes: int, **kwargs) -> Hardware:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cpu_profile(**kwargs)))
    return load_profile(path, processes)


def layout(**changes) -> Layout:
    base = dict(tp=1, pp=1, dp=4, cp=1, zero=0, mbs=1, vpp=1, recompute="none", sp=False, schedule="none")
    return Layout(**{**base, **changes})


def test_threads_slots_and_the_fit_of_each_op_and_group(tmp_path: Path) -> None:
    four, two, one = (hardware(tmp_path, p) for p in (4, 2, 1))
    assert (four.cpu.threads, four.cpu.slots) == (1, 2)  # 4 processes share 2 cores
    assert (two.cpu.threads, two.cpu.slots) == (1, 2)
    assert (one.cpu.threads, one.cpu.slots) == (2, 1)
    link = four.cpu.link("reduce_scatter", 4)  # P = 4, n = 4, op index 2
    assert (link.latency, link.bandwidth) == pytest.approx(((400 + 40 + 2) * 1e-6, 1e9 / (4 * 4 * 3)))
    assert four.cpu.link("send_recv", 4) == four.cpu.link("send_recv", 2)  # only pairs were measured
    assert two.cpu.link("all_reduce", 2).latency == pytest.approx((200 + 20) * 1e-6)
    assert hardware(tmp_path, 8).cpu.link("all_gather", 8).latency == pytest.approx((400 + 40 + 1) * 1e-6)
    assert four.peak_flops == 30e9  # the FLOP fallback: the best total (120) shared by 4


def test_piece_times_scale_to_other_micro_batches_and_stay_per_model(tmp_path: Path) -> None:
    hw = hardware(tmp_path, 4, pieces={BENCH: bench_pieces()})
    assert hw.cpu.piece_times(BENCH, 1, 1).layer_b == pytest.approx(0.080)
    assert hw.cpu.piece_times(BENCH, 1, 3).layer_f == pytest.approx(3 * 0.040)  # ∝ tokens from mbs 1
    assert hw.cpu.piece_times(BENCH, 2, 1).layer_f == pytest.approx(0.040 * 1.1 / 2)
    assert hw.cpu.piece_times(BENCH, 3, 1) is None
    assert hw.cpu.piece_times(arch.PRESETS["ndtrain-small"], 1, 1) is None
    assert hardware(tmp_path, 1, pieces={BENCH: bench_pieces()}).cpu.piece_times(BENCH, 1, 1) is None  # 2 threads


def test_sharing_is_the_chunk_slowdown_beyond_splitting_the_cores(tmp_path: Path) -> None:
    assert hardware(tmp_path, 4, sharing=1.25).cpu.sharing == pytest.approx(1.25)  # 10 ms vs 4 ms × 4/2
    assert hardware(tmp_path, 4, sharing=0.9).cpu.sharing == 1.0  # never below the ideal split
    assert hardware(tmp_path, 2, sharing=1.25).cpu.sharing == 1.0  # 2 processes, 2 slots: nothing shared


def test_the_models_own_sharing_is_preferred(tmp_path: Path) -> None:
    table = bench_pieces()
    table["1"]["sharing"] = {"4": 1.3}
    hw = hardware(tmp_path, 4, pieces={BENCH: table}, sharing=1.1)
    assert hw.cpu.sharing_for(BENCH) == pytest.approx(1.3)
    assert hw.cpu.sharing_for(arch.PRESETS["ndtrain-small"]) == pytest.approx(1.1)  # no layer profile: the chunk's


def test_dp4_step_from_measured_pieces_and_shared_cores(tmp_path: Path) -> None:
    """4 processes on 2 slots: each trains m = 2 micro-batches; the step is at least the 4 processes'
    work over 2 slots (× 1.1 for sharing), so the shared-cores term more than doubles the compute;
    the gradient all-reduce is added."""
    hw = hardware(tmp_path, 4, pieces={BENCH: bench_pieces()}, sharing=1.1)
    t = step_time(BENCH, layout(), Cluster(hw, 4, 4), B)
    per_mb = BENCH.layers * (0.040 + 0.080) + 0.005 + 0.010
    psi = stage_params(BENCH, layout(), "only")
    assert t.compute == pytest.approx(2 * per_mb)
    assert t.optimizer == pytest.approx(psi * 1e-8)
    assert t.dp_comm == pytest.approx(collectives.all_reduce(4, 4 * psi, hw.cpu.link("all_reduce", 4)))
    assert t.compute + t.optimizer + t.shared_cores == pytest.approx(1.1 * 4 * (2 * per_mb + psi * 1e-8) / 2)
    assert t.step == pytest.approx(2.2 * (2 * per_mb + psi * 1e-8) + t.dp_comm)


def test_zero_stages_use_ndtrains_collectives_on_cpu(tmp_path: Path) -> None:
    """ZeRO-1 keeps DDP's all-reduce and adds the all-gather (zero1_optimizer.py); ZeRO-2 reduce-scatters every
    micro-batch; ZeRO-3 gathers everything for the forward, the blocks again for the backward (the root unit,
    embedding, final norm and head, stays gathered) and reduce-scatters everything, per micro-batch; m = 2."""
    hw = hardware(tmp_path, 4, pieces={BENCH: bench_pieces()})
    grads = 4 * stage_params(BENCH, layout(), "only")
    blocks = 4 * BENCH.layers * BENCH.layer_params

    def cost(op: str, nbytes: float = grads) -> float:
        return getattr(collectives, op)(4, nbytes, hw.cpu.link(op, 4))

    dp = {z: step_time(BENCH, layout(zero=z), Cluster(hw, 4, 4), B).dp_comm for z in (1, 2, 3)}
    assert dp[1] == pytest.approx(cost("all_reduce") + cost("all_gather"))
    assert dp[2] == pytest.approx(2 * cost("reduce_scatter") + cost("all_gather"))
    assert dp[3] == pytest.approx(2 * (cost("all_gather") + cost("all_gather", blocks) + cost("reduce_scatter")))


def test_a_pipeline_of_four_on_two_cores_runs_its_schedule_on_the_shared_slots(tmp_path: Path) -> None:
    """pp4 1F1B, m = 8, on 2 slots: the step is ndtrain's 1F1B schedule run on 2 shared slots (each stage
    2 blocks, the ends on the last; its send/recv after each action, holding no slot), then the 4
    processes' optimizer steps on the 2 slots; longer than the 4 processes' work over 2 slots, since
    the warm-up and cool-down leave a slot idle."""
    hw = hardware(tmp_path, 4, pieces={BENCH: bench_pieces()})
    pp4 = step_time(BENCH, layout(pp=4, dp=1, schedule="1f1b"), Cluster(hw, 4, 4), B)
    m, send = 8, pp4.pp_comm / 16

    def cost(action: Action, stage: int) -> Work:
        ends = stage == 3
        if action.kind == "F":
            return Work(2 * 0.040 + 0.005 * ends, send)
        return Work(2 * 0.080 + 0.010 * ends, send)

    schedule = makespan(compute_actions("1f1b", 4, m), 4, 1, cost, Slots(1, 2, 1.0))
    assert pp4.step == pytest.approx(schedule + 4 * pp4.optimizer / 2)
    whole_model = BENCH.layers * (0.040 + 0.080) + 0.015
    assert pp4.step > (m * whole_model + 4 * pp4.optimizer) / 2 + pp4.pp_comm


def test_zero_bubble_pays_for_its_split_backward_on_shared_slots(tmp_path: Path) -> None:
    """ZB-H1's deferred weight passes fill the cool-down, so with a free split (input + weight passes =
    the backward) it beats 1F1B on 4 processes over 2 slots; when the split costs 20 % more than the
    backward (ndtrain's weight pass is one autograd call per weight-consuming node) it does not."""
    def step(schedule: str, overhead: float) -> float:
        hw = hardware(tmp_path, 4, pieces={BENCH: bench_pieces(split_overhead=overhead)})
        return step_time(BENCH, layout(pp=4, dp=1, schedule=schedule), Cluster(hw, 4, 4), B).step

    assert step("zb", 0.0) < step("1f1b", 0.0)
    assert step("zb", 0.2) > step("1f1b", 0.2) == step("1f1b", 0.0)


def test_without_a_layer_profile_compute_comes_from_flops(tmp_path: Path) -> None:
    hw = hardware(tmp_path, 2)
    t = step_time(BENCH, layout(dp=2), Cluster(hw, 2, 2), B)
    assert t.shared_cores == 0.0  # 2 processes, 2 slots
    assert t.compute > 4 * BENCH.seq * BENCH.model_flops_per_token / 60e9  # FLOPs at 60 GFLOP/s + traffic


def test_the_measured_element_wise_rate_prices_the_element_wise_work(tmp_path: Path) -> None:
    """`--calibrate` measures ndtrain's own element-wise layer ops (GB/s of the bytes the eager profile
    counts); without layer pieces that rate, relative to the copy rate, is η_ew (1 in older profiles)."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**cpu_profile(), "elementwise_gbs": {"1": 5.0, "2": 3.0}}))
    measured = load_profile(path, 2)
    assert measured.efficiency.elementwise == pytest.approx(3.0 / 12.0)  # 2 processes: 3 of the copy's 12 GB/s
    older = hardware(tmp_path, 2)
    assert older.efficiency.elementwise == 1.0
    slow, fast = (step_time(BENCH, layout(dp=2), Cluster(hw, 2, 2), B).compute for hw in (measured, older))
    assert slow > fast


def test_the_element_wise_calibration_runs_ndtrains_ops_and_counts_the_eager_profiles_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ndtrain.plan import calibrate_elementwise as ew

    monkeypatch.setattr(ew, "TOKENS", 256)  # the chain runs once here; the calibration's size is larger
    h, f, tokens = ew.HIDDEN, ew.FFN, ew.TOKENS  # fp32: twice the 2-byte counts
    per_token = 2 * 36 * h + 2 * 6 * h + 10 * f + 20 * 2 * h
    assert ew.counted_bytes() == pytest.approx(2 * tokens * per_token)
    ran = []
    assert ew.measure(lambda fn: (ran.append(fn()), 0.5)[1]) == pytest.approx(ew.counted_bytes() / 0.5 / 1e9)
    assert len(ran) == 1  # the chain of ndtrain's ops ran once, under the timer


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not an ndtrain CPU profile"):
        (tmp_path / "x.json").write_text("{}")
        load_profile(tmp_path / "x.json", 4)


def test_the_profiled_block_is_ndtrains_block() -> None:
    """At tp = 1 the calibration's stack of blocks computes what `models.llama.Block`s compute with the
    same weights."""
    import torch

    from ndtrain.config import ModelConfig
    from ndtrain.models.llama import Block
    from ndtrain.plan.calibrate_layers import Shard

    spec = arch.ModelSpec("t", "llama", 1, 32, 4, 2, 64, 256, 16)
    shard = Shard(spec, 1, 2, blocks=2)
    blocks = [Block(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=16)) for _ in range(2)]
    with torch.no_grad():
        for block, w in zip(blocks, shard.weights):
            for module, name in ((block.attention.wq, "wq"), (block.attention.wk, "wk"), (block.attention.wv, "wv"),
                                 (block.attention.wo, "wo"), (block.feed_forward.w1, "w1"),
                                 (block.feed_forward.w3, "w3"), (block.feed_forward.w2, "w2")):
                module.weight.copy_(w[name])
            block.attention_norm.weight.copy_(torch.rand(32))
            block.ffn_norm.weight.copy_(torch.rand(32))
            w["norms"][0].copy_(block.attention_norm.weight)
            w["norms"][1].copy_(block.ffn_norm.weight)
        expected = blocks[1](blocks[0](shard.x, shard.cos, shard.sin), shard.cos, shard.sin)
        torch.testing.assert_close(shard.stack(), expected, rtol=1e-6, atol=1e-6)


def test_measure_covers_every_tp_and_micro_batch() -> None:
    """Every piece runs (forward, forward + backward, forward + input pass, forward + input + weight passes)
    for each (tp, mbs); the result has the keys the profile reader expects. `timed` is a stand-in that
    runs the function once and returns the next of a cycle of times."""
    from ndtrain.plan import calibrate_layers
    from ndtrain.plan.cpu_profile import PieceTimes, profiled_tps

    spec = arch.ModelSpec("t", "llama", 2, 32, 4, 2, 64, 256, 16)
    calls: list[str] = []
    # stack: f 0.5, f+b 2.0, f+I 1.5, f+I+W 2.5; ends: f 0.5, f+b 2.0
    times = (0.5, 2.0, 1.5, 2.5, 0.5, 2.0)

    def once(fn) -> float:
        fn()
        calls.append("x")
        return times[(len(calls) - 1) % len(times)]

    tps = profiled_tps(spec, 4)
    assert tps == [1, 2, 4]
    result = calibrate_layers.measure(spec, tps, once)
    assert set(result) == {f"tp{t} mbs{b}" for t in tps for b in calibrate_layers.MICRO_BATCHES} | {"adamw"}
    assert PieceTimes(**result["tp4 mbs2"]) == PieceTimes(0.25, 0.75, 0.5, 1.5, 0.5, 0.5)  # the stack of 2 blocks ÷ 2
    assert result["adamw"]["s_per_param"] > 0


def test_the_split_backward_piece_computes_the_same_gradients_as_the_backward() -> None:
    """The calibration times zero-bubble's real split (split_backward.WeightPasses): its input pass and
    weight passes give every weight the gradient one backward gives, and the graph splits cleanly."""
    import torch

    from ndtrain.parallel.pipeline.split_backward import WeightPasses
    from ndtrain.plan import calibrate_layers

    spec = arch.ModelSpec("t", "llama", 2, 32, 4, 2, 64, 256, 16)
    shard = calibrate_layers.Shard(spec, 1, 1, spec.layers)
    params = shard.block_parameters()
    shard.stack().backward(shard.grad_out)
    full = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    assert WeightPasses(shard.stack(), params).complete  # the runner's split, not its fallback
    shard.split_backward(True)
    for got, want in zip((p.grad for p in params), full):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_optimizer_piece_is_the_engines_step_over_tensors_shaped_as_the_model() -> None:
    """`adamw` times what Engine.train_step does after the backward: the gradient's norm and clip, AdamW,
    zeroed gradients, over the model's ends and whole blocks (≥ ADAMW_ELEMENTS elements in all)."""
    import torch

    from ndtrain.plan import calibrate_layers

    spec = arch.ModelSpec("t", "llama", 2, 32, 4, 2, 64, 256, 16)
    params = calibrate_layers._step_parameters(spec)
    block = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64), (32,), (32,)]
    shapes = [tuple(p.shape) for p in params]
    assert shapes[:3] == [(256, 32), (256, 32), (32,)] and shapes[3:12] == block
    assert (len(shapes) - 3) % len(block) == 0 and shapes[3:] == block * ((len(shapes) - 3) // len(block))
    assert sum(p.numel() for p in params) >= calibrate_layers.ADAMW_ELEMENTS
    before = [p.detach().clone() for p in params[:3]]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    calibrate_layers._step_passes(params, optimizer)()
    assert all(not p.grad.any() for p in params)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_calibration_workers_that_overrun_end_in_one_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that cannot finish in time (here: waiting at a barrier for a second worker that never comes,
    as a worker starved by a busy machine never reports) ends the calibration in one UserError naming the
    fix, and the worker is stopped."""
    import multiprocessing as mp

    from ndtrain.plan import calibrate

    monkeypatch.setattr(calibrate, "WORKER_TIMEOUT_S", 1.0)
    ctx = mp.get_context("spawn")
    with pytest.raises(UserError, match="did not finish within 1 s: .* again on a quiet machine"):
        calibrate._spawn(ctx, calibrate._sharing_worker, [(1, BENCH, ctx.Barrier(2))])
