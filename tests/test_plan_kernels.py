"""Kernel profiles (`ndtrain/plan/kernels.py`): the software stack as an input of the GPU model.

Pure arithmetic: the bytes each profile's element-wise kernels move, FP8 GEMMs at the FP8 peak, and
the refusals (`--kernels` with an FP8 profile on a GPU without FP8 tensor cores)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ndtrain.errors import UserError
from ndtrain.plan import gpu_compute
from ndtrain.plan.arch import PRESETS
from ndtrain.plan.hardware import gpu
from ndtrain.plan.kernels import COMPILED, EAGER, FUSED, FUSED_FP8, PROFILES, profile
from ndtrain.plan.layout import Layout

LLAMA3_8B = PRESETS["llama3-8b"]  # h 4096, 32 heads of 128, 8 kv heads, f 14336, seq 8192


def layout(tp: int = 1, sp: bool = False, recompute: str = "none") -> Layout:
    return Layout(tp, 1, 8 // tp, 1, 1, 1, 1, recompute, sp, "none")


@pytest.mark.parametrize("kernels, per_token", [
    # 2 RMSNorms + 2 residual adds over h (replicated at tp 2 without SP), SwiGLU over f/2, RoPE over (32+8)·128/2
    (EAGER, 2 * 36 * 4096 + 2 * 6 * 4096 + 10 * 14336 / 2 + 20 * 40 * 128 / 2),
    (FUSED, 2 * 4 * 4096 + 2 * 6 * 4096 + 6 * 14336 / 2 + 4 * 40 * 128 / 2),
    (COMPILED, 2 * 4 * 4096 + 2 * 6 * 4096 + 6 * 14336 / 2 + 4 * 40 * 128 / 2),
    # FP8: + 3 bytes per element of the four GEMM inputs (h, h, 32·128/2, f/2)
    (FUSED_FP8, 2 * 4 * 4096 + 2 * 6 * 4096 + 6 * 14336 / 2 + 4 * 40 * 128 / 2
     + 3 * (2 * 4096 + 32 * 128 / 2 + 14336 / 2)),
])
def test_element_bytes_of_a_llama_layer_are_the_profiles_counts(kernels, per_token: float) -> None:
    hw = gpu("h100-sxm", kernels=kernels)
    layer, scores = gpu_compute.element_bytes(LLAMA3_8B, layout(tp=2), hw)
    assert layer == pytest.approx(8192 * per_token) and scores == 0.0  # flash attention stores no scores


def test_an_fp8_backward_casts_the_products_output_gradients() -> None:
    """Twice the forward's bytes per op, but FP8 casts over what the backward's products read: the output
    gradients of QKV ((32+2·8)·128/2), the attention output (h), SwiGLU's input (2f/2) and the MLP (h)."""
    hw = gpu("h100-sxm", kernels=FUSED_FP8)
    layer, scores = gpu_compute.element_bytes(LLAMA3_8B, layout(tp=2), hw, backward=True)
    ops = 2 * 4 * 4096 + 2 * 6 * 4096 + 6 * 14336 / 2 + 4 * 40 * 128 / 2
    assert layer == pytest.approx(8192 * 2 * (ops + 3 * (48 * 128 / 2 + 2 * 4096 + 2 * 14336 / 2))) and scores == 0.0
    no_fp8 = gpu("h100-sxm", kernels=FUSED)
    assert gpu_compute.element_bytes(LLAMA3_8B, layout(tp=2), no_fp8, backward=True) == pytest.approx(
        tuple(2 * b for b in gpu_compute.element_bytes(LLAMA3_8B, layout(tp=2), no_fp8)))


def test_sequence_parallelism_shards_the_hidden_wide_kernels() -> None:
    hw = gpu("h100-sxm", kernels=FUSED)
    with_sp, _ = gpu_compute.element_bytes(LLAMA3_8B, layout(tp=2, sp=True), hw)
    assert with_sp == pytest.approx(8192 * (2 * 4 * 2048 + 2 * 6 * 2048 + 6 * 14336 / 2 + 4 * 40 * 128 / 2))


def test_a_dense_gpt_layer_adds_its_score_chain_and_dropout() -> None:
    spec = PRESETS["gpt3-1.3b"]  # h 2048, 16 heads, seq 2048, dropout (Megatron's practice), dense attention
    hw = gpu("a100-80gb", kernels=FUSED)
    layer, scores = gpu_compute.element_bytes(spec, layout(), hw)
    # LayerNorm 4, residual 6 + dropout mask 1, GeLU 4 over 4h; scores: softmax chain 8 + dropout 5 over a·s
    assert layer == pytest.approx(2048 * (2 * 4 * 2048 + 2 * 7 * 2048 + 4 * 8192))
    assert scores == pytest.approx(2048 * 13 * 16 * 2048)
    no_dropout = replace(spec, dropout=False)
    assert gpu_compute.element_bytes(no_dropout, layout(), hw) == pytest.approx(
        (2048 * (2 * 4 * 2048 + 2 * 6 * 2048 + 4 * 8192), 2048 * 8 * 16 * 2048))


def test_element_wise_time_is_the_bytes_at_eta_ew_of_hbm() -> None:
    hw = gpu("h100-sxm", kernels=EAGER)
    terms = gpu_compute.layer_terms(LLAMA3_8B, layout(), hw)
    assert terms.element == pytest.approx(sum(gpu_compute.element_bytes(LLAMA3_8B, layout(), hw))
                                          / (hw.efficiency.elementwise * hw.hbm_bandwidth))
    fused = gpu_compute.layer_terms(LLAMA3_8B, layout(), gpu("h100-sxm", kernels=FUSED))
    assert fused.element < terms.element / 2 and fused.gemm == terms.gemm
    # eager calls PyTorch's attention kernel, fused Transformer Engine's: each at its own efficiency
    eff = hw.efficiency
    assert fused.attention == pytest.approx(terms.attention * eff.attention / eff.attention_te)


def test_hopper_gemms_run_at_their_own_efficiency() -> None:
    a100, h100 = gpu("a100-80gb"), gpu("h100-sxm")
    eff = h100.efficiency
    assert (a100.tensor_cores, h100.tensor_cores, gpu("b200").tensor_cores) == ("ampere", "hopper", "blackwell")
    work = [gpu_compute.gemm_terms(8192, 4096, 4096, hw, eff) for hw in (a100, h100)]
    traffic = [2 * (8192 * 4096 + 4096 * 4096 + 8192 * 4096) / hw.hbm_bandwidth for hw in (a100, h100)]
    assert work[0].work - traffic[0] == pytest.approx(2 * 8192 * 4096 * 4096 / (eff.matmul * a100.peak_flops))
    assert work[1].work - traffic[1] == pytest.approx(2 * 8192 * 4096 * 4096 / (eff.matmul_hopper * h100.peak_flops))


def test_fp8_runs_the_layer_gemms_at_the_fp8_peak_with_one_byte_operands() -> None:
    hw = gpu("h100-sxm", kernels=FUSED_FP8)
    eff, tokens = hw.efficiency, 8192
    fp8 = gpu_compute.gemm_terms(tokens, 4096, 14336, hw, eff, fp8=True)
    arithmetic = 2 * tokens * 4096 * 14336 / (eff.fp8_matmul * hw.fp8_peak_flops)
    traffic = (tokens * 4096 + 4096 * 14336 + 2 * tokens * 14336) / hw.hbm_bandwidth
    assert fp8.work == pytest.approx(arithmetic + traffic)
    bf16 = gpu_compute.layer_terms(LLAMA3_8B, layout(), gpu("h100-sxm", kernels=FUSED))
    assert gpu_compute.layer_terms(LLAMA3_8B, layout(), hw).gemm < bf16.gemm


def test_profiles_are_named_and_fp8_needs_fp8_tensor_cores() -> None:
    assert set(PROFILES) == {"eager", "fused", "fused-fp8", "compiled", "compiled-fp8"}
    assert profile("fused") is FUSED
    with pytest.raises(UserError, match="--kernels 'cudnn' is unknown"):
        profile("cudnn")
    with pytest.raises(UserError, match="--kernels fused-fp8 runs FP8 GEMMs, which a100-80gb has no tensor cores"):
        gpu("a100-80gb", kernels=FUSED_FP8)
    assert gpu("b200", kernels=FUSED_FP8).fp8_peak_flops == 4500e12
