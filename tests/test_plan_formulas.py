"""Every planner formula against hand-computed values (pure arithmetic: no processes, no torch.distributed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ndtrain.config import MODEL_PRESETS, ModelConfig
from ndtrain.plan import arch, collectives, schedules
from ndtrain.plan.calibrate_comm import fit_alpha_beta
from ndtrain.plan.efficiency import GPU_TILE
from ndtrain.plan.hardware import FP32, MIXED_BF16, Cluster, Link, gpu
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import layer_activation_bytes, model_states, stage_activations, stage_params
from ndtrain.plan.timing import flops_per_step, step_time
from ndtrain.plan.validate import agreement, compare, ranks, spearman


def layout(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, zero: int = 0, mbs: int = 1, vpp: int = 1,
           recompute: str = "none", sp: bool = False, schedule: str | None = None) -> Layout:
    return Layout(tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule or ("none" if pp == 1 else "1f1b"))


# --- parameter counts -------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("llama2-7b", 6_738_415_616),
    ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800),
])
def test_llama_parameter_counts_match_the_released_models(name: str, expected: int) -> None:
    assert arch.PRESETS[name].total_params == expected


def test_gpt3_175b_parameter_count() -> None:
    spec = arch.PRESETS["gpt3-175b"]
    l, h, v, s = spec.layers, spec.hidden, spec.vocab, spec.seq
    formula = 12 * l * h * h + 13 * l * h + v * h  # Narayanan 2021: 12·l·h²·(1 + 13/(12h)) + V·h
    assert formula == 174_579_068_928
    assert spec.total_params == formula + s * h + 2 * h  # + learned positions + final LayerNorm
    assert round(spec.total_params / 1e9, 1) == 174.6


def test_ndtrain_preset_count_matches_the_torch_model() -> None:
    from ndtrain.models.llama import Llama

    cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], "preset": "tiny"})
    torch_count = sum(p.numel() for p in Llama(cfg).parameters())
    assert arch.PRESETS["ndtrain-tiny"].total_params == torch_count


def test_explicit_llama_default_ffn_is_llama2s() -> None:
    spec = arch.explicit("llama", 32, 4096, 32, None, None, 32000, 4096)
    assert spec.ffn == 11008 and spec.total_params == 6_738_415_616


# --- FLOPs ------------------------------------------------------------------------------------

def test_gpt_flops_are_narayanans_72_and_96_formulas() -> None:
    spec = arch.ModelSpec("g", "gpt", 96, 12288, 96, 96, 4 * 12288, 51200, 2048)
    b, s, l, h, v = 64, spec.seq, spec.layers, spec.hidden, spec.vocab
    model, hardware = flops_per_step(spec, layout(recompute="full"), b)
    assert model == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), rel=1e-12)
    assert hardware == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)
    selective = flops_per_step(spec, layout(recompute="selective"), b)[1]
    assert selective - model == b * s * l * 4 * s * h  # QKᵀ and AV once more


def test_llama_attention_is_causal_flash() -> None:
    spec = arch.PRESETS["llama3-8b"]
    assert spec.attention_forward_flops_per_token == 2 * spec.seq * spec.hidden
    w = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o, k, v, w1..w3
    assert spec.layer_forward_flops_per_token == 2 * w + 2 * spec.seq * spec.hidden
    model, hardware = flops_per_step(spec, layout(), 1)
    assert hardware - model == spec.seq * spec.layers * spec.attention_forward_flops_per_token  # flash backward


# --- memory -----------------------------------------------------------------------------------

GPT = arch.ModelSpec("g", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048)


@pytest.mark.parametrize("tp, sp, recompute, per_sbh, per_as2b", [
    (1, False, "none", 34, 5),
    (4, False, "none", 10 + 24 / 4, 5 / 4),
    (4, True, "none", 34 / 4, 5 / 4),
    (4, True, "selective", 34 / 4, 0),
    (4, False, "selective", 10 + 24 / 4, 0),
    (1, False, "full", 2, 0),
    (4, True, "full", 2 / 4, 0),
])
def test_korthikanti_activations_per_layer(tp: int, sp: bool, recompute: str, per_sbh: float, per_as2b: float) -> None:
    b, s, h, a = 2, GPT.seq, GPT.hidden, GPT.heads
    got = layer_activation_bytes(GPT, layout(tp=tp, sp=sp, mbs=b, recompute=recompute), MIXED_BF16, recompute)
    assert got == pytest.approx(s * b * h * per_sbh + a * s * s * b * per_as2b)


def test_llama_activations_with_gqa_and_context_parallel() -> None:
    spec = arch.PRESETS["llama3-8b"]  # k/a = 1/4, f/h = 3.5
    s, h = spec.seq, spec.hidden
    per_sbh = 8 + 2 * (2 + 2 * 0.25 + 3 * 3.5)  # R = 8, S = 26: no score matrix (flash)
    assert per_sbh == 34
    got = layer_activation_bytes(spec, layout(cp=4), MIXED_BF16, "none")
    assert got == pytest.approx(s / 4 * h * per_sbh)
    fp32 = layer_activation_bytes(spec, layout(), FP32, "none")
    assert fp32 == pytest.approx(2 * s * h * per_sbh)


def test_zero_stages_follow_the_paper() -> None:
    spec, n = GPT, 8
    psi = stage_params(spec, layout(dp=n), "only")
    assert psi == spec.total_params
    states = [model_states(spec, layout(dp=n, zero=z), MIXED_BF16, "only") for z in range(4)]
    assert states[0] == (2 * psi, 2 * psi, 12 * psi)
    assert states[1] == pytest.approx((2 * psi, 2 * psi, 12 * psi / n))
    assert states[2] == pytest.approx((2 * psi, 2 * psi / n, 12 * psi / n))
    gathered = 2 * spec.layer_params
    assert states[3] == pytest.approx((2 * psi / n + 2 * gathered, 2 * psi / n + 2 * gathered, 12 * psi / n))
    # context-parallel ranks shard ZeRO state too: dp=2 × cp=4 is the same N as dp=8
    assert model_states(spec, layout(dp=2, cp=4, zero=1), MIXED_BF16, "only") == pytest.approx(states[1])


def test_zero_paper_figure_1_example() -> None:
    psi, n = 7.5e9, 64  # Rajbhandari 2020, Figure 1: 120, 31.4, 16.6, 1.9 GB
    assert [round(x / 1e9, 1) for x in (16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n,
                                        16 * psi / n)] == [120.0, 31.4, 16.6, 1.9]


def test_stage_params_split_embedding_and_head() -> None:
    lay = layout(tp=2, pp=4)
    per_layer = GPT.layer_params * 6 / 2
    assert stage_params(GPT, lay, "first") == pytest.approx(per_layer + GPT.embedding_params / 2)
    assert stage_params(GPT, lay, "last") == pytest.approx(per_layer + (GPT.head_params + GPT.vocab * GPT.hidden) / 2)


def test_pipeline_in_flight_activations() -> None:
    one_layer = layer_activation_bytes(GPT, layout(), MIXED_BF16, "none")
    # 1F1B: p micro-batches × l/p layers = all l layers' worth on the first stage (Korthikanti §4.2.3)
    first = stage_activations(GPT, layout(pp=4), MIXED_BF16, 16, "first")
    mask = 4 * GPT.seq * GPT.hidden  # embedding dropout mask, 1 byte, per micro-batch in flight
    assert first == pytest.approx(24 * one_layer + mask)
    gpipe = stage_activations(GPT, layout(pp=4, schedule="gpipe"), MIXED_BF16, 16, "first")
    assert gpipe == pytest.approx(16 * 6 * one_layer + 16 * GPT.seq * GPT.hidden)
    assert schedules.first_stage_in_flight("interleaved", 4, 16, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert schedules.first_stage_in_flight("zb", 4, 16, 1) == 4
    assert schedules.first_stage_in_flight("1f1b", 8, 3, 1) == 3


# --- time -------------------------------------------------------------------------------------

def test_bubbles() -> None:
    assert schedules.bubble_fraction("1f1b", 8, 64) == pytest.approx(7 / 71)
    assert schedules.bubble_fraction("gpipe", 4, 12) == pytest.approx(3 / 15)
    assert schedules.bubble_time("interleaved", 8, 4, 1.0, 2.0) == pytest.approx(7 * 3 / 4)
    assert schedules.bubble_time("zb", 8, 1, 1.0, 2.0) == pytest.approx(7 * 1.0)  # (p−1)(t_F + t_B − t_W)
    assert schedules.bubble_time("1f1b", 1, 1, 1.0, 2.0) == 0.0


def test_alpha_beta_ring_collectives() -> None:
    link = Link(100e9, 5e-6)
    assert collectives.all_reduce(8, 1e9, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    assert collectives.reduce_scatter(8, 1e9, link) == pytest.approx(7 * 5e-6 + 7 / 8 * 1e-2)
    assert collectives.all_gather(4, 4e6, link) == pytest.approx(3 * 5e-6 + 3 / 4 * 4e-5)
    assert collectives.send_recv(1e6, link) == pytest.approx(5e-6 + 1e-5)
    assert collectives.all_reduce(1, 1e9, link) == 0.0
    assert collectives.exposed(10.0, 8.0, 0.5) == 2.0
    assert collectives.exposed(10.0, 20.0, 0.5) == 0.5


def test_links_by_group_span() -> None:
    cluster = Cluster(gpu("a100-80gb"), 64, 8)
    assert cluster.link(1, 8) is cluster.hardware.intra  # tp=8 inside a node
    assert cluster.link(8, 8) is cluster.hardware.inter  # dp across nodes
    assert cluster.link(2, 4) is cluster.hardware.intra
    # a group with q members per node runs q rings over q NICs: q × one NIC, capped by NVLink
    assert cluster.link(2, 32).bandwidth == 4 * cluster.hardware.inter.bandwidth
    assert cluster.link(1, 64).bandwidth == 8 * cluster.hardware.inter.bandwidth  # 192 < 240 GB/s NVLink
    h100 = Cluster(gpu("h100-sxm"), 64, 8)
    assert h100.link(1, 64).bandwidth == h100.hardware.intra.bandwidth  # 8 × 48 capped at 360
    assert cluster.link(2, 32).latency == cluster.hardware.inter.latency
    # a send between neighbours: NVLink inside a node, else one NIC (all 8 GPUs of a node send at once)
    assert cluster.pair_link(2, 4) is cluster.hardware.intra
    assert cluster.pair_link(2, 32) is cluster.pair_link(8, 8) is cluster.hardware.inter


def test_step_time_of_a_single_gpu_is_the_sum_of_its_terms() -> None:
    """With wave quantization stated (128 × 256 tiles: the ablation's variant; the planner's constants
    state no tile), so each term's formula is checked."""
    hw = gpu("a100-80gb")
    hw = replace(hw, efficiency=replace(hw.efficiency, tile=GPU_TILE))
    eff, beta = hw.efficiency, 2
    spec = arch.ModelSpec("g", "gpt", 2, 1024, 16, 16, 4096, 1000, 512)
    timing = step_time(spec, layout(), Cluster(hw, 1, 8), 4)
    tokens, h, f, v = 512, 1024, 4096, 1000

    def idle(rows: int, cols: int) -> float:  # 1/fill − 1 of 128×256 tiles in waves over 108 SMs
        tiles = -(-rows // 128) * -(-cols // 256)
        return -(-tiles // 108) * 108 / tiles - 1

    def arithmetic(m: int, k: int, n: int) -> float:
        return 2 * m * k * n / (eff.matmul * hw.peak_flops)

    def gemm(m: int, k: int, n: int) -> tuple[float, float]:  # forward, backward (dX: m×k, dW: k×n outputs)
        work = arithmetic(m, k, n) + beta * (m * k + k * n + m * n) / hw.hbm_bandwidth
        return (work + arithmetic(m, k, n) * idle(m, n),
                2 * work + arithmetic(m, k, n) * (idle(m, k) + idle(k, n)))

    products = [gemm(tokens, h, 3 * h), gemm(tokens, h, h), gemm(tokens, h, f), gemm(tokens, f, h)]
    attention = tokens * 4 * 512 * h / (eff.matmul * hw.peak_flops)  # dense kernel: batched GEMMs
    # the default kernel profile (eager): LayerNorm 4, residual 6 + dropout 5, GeLU 4 per element; the dense
    # score chain 13 + dropout 5 per score; cross-entropy 14 per logit; at η_ew of the HBM bandwidth
    bandwidth = eff.elementwise * hw.hbm_bandwidth
    element = tokens * (2 * 4 * h + 2 * 11 * h + 4 * f + 18 * 16 * 512) / bandwidth
    loss = 14 * tokens * v / bandwidth
    logits_f, logits_b = gemm(tokens, h, v)
    layer_f = sum(f for f, _ in products) + attention + element
    layer_b = sum(b for _, b in products) + 2 * (attention + element)
    per_micro_batch = 2 * (layer_f + layer_b) + logits_f + logits_b + 3 * loss  # 2 layers, the ends
    assert timing.compute == pytest.approx(4 * per_micro_batch)
    assert timing.tp_comm == timing.dp_comm == timing.bubble == 0.0
    assert timing.optimizer == pytest.approx(spec.total_params * 28 / hw.hbm_bandwidth)


def test_a_pipeline_boundary_is_the_activation_each_tp_rank_holds() -> None:
    """ndtrain's runner and DeepSpeed's pipeline engine send each tp rank's whole activation (1/t of it
    with SP, split by sequence); Megatron-LM's scatter/gather sends 1/t and all-gathers it on arrival."""
    cluster = Cluster(gpu("a100-80gb"), 16, 8)
    link = cluster.pair_link(2, 2)  # pp neighbours 2 ranks apart: inside a node
    boundary = 2048 * GPT.hidden * 2  # mbs 1 · s · h · β
    m = 2  # global batch 8 over dp 4

    def pp_comm(sp: bool, scatter: bool = False) -> float:
        on = Cluster(replace(cluster.hardware, pp_scatter_gather=scatter), 16, 8)
        return step_time(GPT, Layout(2, 2, 4, 1, 1, 1, 1, "full", sp, "1f1b"), on, 8).pp_comm

    assert pp_comm(sp=False) == pytest.approx(m * 2 * collectives.send_recv(boundary, link))
    assert pp_comm(sp=True) == pytest.approx(m * 2 * collectives.send_recv(boundary / 2, link))
    gathered = collectives.send_recv(boundary / 2, link) + collectives.all_gather(2, boundary, cluster.link(1, 2))
    assert pp_comm(sp=False, scatter=True) == pytest.approx(m * 2 * gathered)
    assert pp_comm(sp=True, scatter=True) == pp_comm(sp=True)  # SP's boundary is split already


# --- validation hook, calibration fit, CPU profile --------------------------------------------

def test_spearman_and_median_error_on_synthetic_data() -> None:
    assert ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    result = agreement([1.0, 2.0, 3.0, 4.0, 5.0], [1.1, 2.5, 2.9, 4.4, 5.0])
    assert result.spearman == pytest.approx(1.0)
    assert result.median_relative_error == pytest.approx(0.1 / 1.1)
    assert result.acceptable()
    assert not agreement([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]).acceptable()


def test_compare_predicts_each_measured_layout() -> None:
    spec, cluster = arch.PRESETS["ndtrain-bench"], Cluster(gpu("a100-80gb"), 4, 8)
    layouts = [layout(dp=4), layout(dp=4, zero=1), layout(tp=2, dp=2), layout(pp=2, dp=2)]
    measured = {lay: 1.2 * step_time(spec, lay, cluster, 16).step for lay in layouts}
    result = compare(measured, spec, cluster, 16)
    assert result.layouts == 4 and result.spearman == pytest.approx(1.0)
    assert result.median_relative_error == pytest.approx(1 - 1 / 1.2)


@pytest.mark.parametrize("op, n, c_alpha, c_beta", [
    ("all_reduce", 4, 6, 1.5), ("all_gather", 4, 3, 0.75), ("reduce_scatter", 2, 1, 0.5), ("send_recv", 2, 1, 1),
])
def test_alpha_beta_fit_recovers_synthetic_link(op: str, n: int, c_alpha: float, c_beta: float) -> None:
    alpha, bandwidth = 200e-6, 2e9
    at = lambda m: c_alpha * alpha + c_beta * m / bandwidth  # noqa: E731
    assert fit_alpha_beta(op, n, [(m, at(m)) for m in (4096, 8 << 20)]) == pytest.approx((alpha, bandwidth))
    assert fit_alpha_beta(op, n, [(m, at(m)) for m in (32 << 10, 512 << 10, 16 << 20)]) == pytest.approx(
        (alpha, bandwidth))
    # noise of ±10 % on the small message moves α by about that much, not by the large message's error
    noisy = [(32 << 10, 1.1 * at(32 << 10)), (512 << 10, at(512 << 10)), (16 << 20, 0.9 * at(16 << 20))]
    fitted_alpha, fitted_bandwidth = fit_alpha_beta(op, n, noisy)
    assert fitted_alpha == pytest.approx(alpha, rel=0.2) and fitted_bandwidth == pytest.approx(bandwidth, rel=0.15)
