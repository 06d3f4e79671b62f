"""Seconds of one micro-batch's compute on a GPU, term by term, from datasheet numbers and the
universal efficiencies of `efficiency.py` (the same for every GPU; a CPU profile without layer
profiles uses the same terms with `efficiency.measured`).

One layer's forward on one rank, T = b·s/c tokens, t tp, P peak FLOP/s, B HBM bytes/s, β bytes
per value:

gemm       the layer's four matrix products (QKV, attention output, MLP in, MLP out; SwiGLU's
           two input matrices are one product of width 2f/t), each of shape T×K times K×N:
               2·T·K·N / (η_mm·P)  +  (β_in·(T·K + K·N) + β·T·N) / B
           the arithmetic at the achievable fraction η_mm of peak (η_mm,H on Hopper and later),
           plus reading both operands
           and writing the result once from HBM (the roofline's memory side, added: a product
           of small K or N is memory-bound, and the more so the higher P/B, which is how the
           generation enters: P/B is 153 FLOP/byte on A100-80GB, 295 on H100 SXM). With an FP8
           kernel profile the four products run at η_fp8 of the FP8 peak with 1-byte operands
           (β_in = 1); otherwise β_in = β
waves      wave quantization, only when the constants state a tile (the ablation's variant; the planner's
           constants state none: leave-one-source-out it raised the error, docs/planner.md):
           a GEMM runs as ⌈T/128⌉·⌈N/256⌉ output tiles (`efficiency.GPU_TILE`),
           one per SM at a time, in ⌈tiles/SMs⌉ waves; the last wave's idle SMs cost
               arithmetic · (waves·SMs/tiles − 1)
           (a GEMM of 336 tiles takes 4 waves on an A100's 108 SMs, 78 % of them busy; 3 on an
           H100's 132, 85 %): what makes small GEMMs (high tp, small micro-batches) slower per FLOP
attention  QKᵀ and AV, c·4·s·a·d·T/t FLOPs: flash attention (c = ½, causal) at η_attn·P, the
           fraction the profile's fused kernel reaches (PyTorch's or Transformer Engine's); the
           dense kernel (c = 1) runs them as batched GEMMs at η_mm·P, its score matrix's traffic
           being element-wise work (below)
element    memory-bound element-wise work at η_ew of B: the bytes the run's kernel profile moves
           (`kernels.py`: norms, residual adds, dropout, activation, RoPE, FP8 casts per token, and
           for dense attention the score matrix's chain, counted from each stack's code)
Backward = 2 × forward, term by term (two products per forward product; the element-wise and
attention backward read and write twice as much; with FP8, the casts are of the products' output
gradients), except the waves: the backward's products have other output shapes (the input
gradient T×K, the weight gradient K×N, whose tiles do not depend on the tokens). Recompute
adds: full, one layer forward; selective, the attention term (and, for a stored score matrix,
its element-wise chain); flash attention always recomputes its scores in the backward (Dao
2022), so "none" adds the attention term too; "op" (torchtitan's selective op checkpointing,
which saves every op's output but every second matmul's; published runs only) half the products
and the element-wise work. The model's ends on the last stage: the logits product T×h times
h×V/t (bf16) and the cross-entropy's bytes per logit of the profile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.hardware import Hardware
from ndtrain.plan.kernels import LayerWidths
from ndtrain.plan.layout import Layout


class LayerTerms(NamedTuple):
    """Seconds of one layer forward on one rank, by term."""

    gemm: float  # arithmetic of full waves and operand traffic
    waves: float  # the last waves' idle SMs
    attention: float
    element: float

    @property
    def total(self) -> float:
        return self.gemm + self.waves + self.attention + self.element


class GpuCompute(NamedTuple):
    layer: LayerTerms  # forward of one layer
    layer_b: float  # backward of one layer (2 × forward but for its own waves and FP8 casts)
    recompute: float  # added to one layer's backward
    ends_f: float  # logits and loss forward (last stage)
    ends_b: float
    attention_f: float  # one layer's attention forward (what cp's ring hides behind)


class GemmTime(NamedTuple):
    work: float  # arithmetic at η_mm of peak + operand traffic
    waves: float  # arithmetic lost to the idle SMs of the last wave

    @property
    def total(self) -> float:
        return self.work + self.waves


def wave_fill(rows: float, cols: float, hw: Hardware, eff: GpuEfficiency) -> float:
    """Fraction of SM slots a GEMM's tiles fill over its waves (1 without a tile or SM count)."""
    if eff.tile is None or hw.sms == 0:
        return 1.0
    tiles = math.ceil(rows / eff.tile[0]) * math.ceil(cols / eff.tile[1])
    return tiles / (math.ceil(tiles / hw.sms) * hw.sms)


def _arithmetic(rows: float, inner: float, cols: float, hw: Hardware, eff: GpuEfficiency, fp8: bool) -> float:
    rate = eff.fp8_matmul * hw.fp8_peak_flops if fp8 else eff.gemm(hw.tensor_cores) * hw.peak_flops
    return 2 * rows * inner * cols / rate


def gemm_terms(rows: float, inner: float, cols: float, hw: Hardware, eff: GpuEfficiency,
               fp8: bool = False) -> GemmTime:
    beta = hw.precision.activation_bytes
    operand = 1 if fp8 else beta
    arithmetic = _arithmetic(rows, inner, cols, hw, eff, fp8)
    traffic = (operand * (rows * inner + inner * cols) + beta * rows * cols) / hw.hbm_bandwidth
    return GemmTime(arithmetic + traffic, arithmetic * (1 / wave_fill(rows, cols, hw, eff) - 1))


def backward_waves(rows: float, inner: float, cols: float, hw: Hardware, eff: GpuEfficiency,
                   fp8: bool = False) -> float:
    """Idle-SM seconds of a forward product's two backward products: the input gradient (output
    rows × inner) and the weight gradient (output inner × cols), each with the forward's arithmetic."""
    arithmetic = _arithmetic(rows, inner, cols, hw, eff, fp8)
    return sum(arithmetic * (1 / wave_fill(r, c, hw, eff) - 1) for r, c in ((rows, inner), (inner, cols)))


def element_bytes(model: ModelSpec, layout: Layout, hw: Hardware, backward: bool = False) -> tuple[float, float]:
    """(bytes of one layer's element-wise kernels, bytes of its score matrix's chain) for one
    micro-batch forward (or backward) on one rank, as the hardware's kernel profile counts them."""
    k, t = hw.kernels, layout.tp
    d, ffn = model.head_dim, model.token_ffn / t
    widths = LayerWidths(hidden=model.hidden / (t if layout.sp else 1), ffn=ffn,
                         qk=(model.heads + model.kv_heads) * d / t, attention=model.heads * d / t,
                         qkv=(model.heads + 2 * model.kv_heads) * d / t,
                         mlp_in=(2 if model.arch == "llama" else 1) * ffn)
    per_token = k.layer_bytes_per_token(model.arch, widths, model.has_dropout, backward)
    scores = 0.0 if model.flash_attention else k.score_bytes(model.has_dropout, backward) * model.heads * model.seq / t
    tokens, scale = layout.mbs * model.seq / layout.cp, hw.precision.activation_bytes / 2
    return tokens * per_token * scale, tokens * scores * scale


def layer_terms(model: ModelSpec, layout: Layout, hw: Hardware) -> LayerTerms:
    eff = hw.efficiency
    t = layout.tp
    tokens = layout.mbs * model.seq / layout.cp
    fp8 = hw.kernels.fp8
    gemms = [gemm_terms(tokens, inner, cols, hw, eff, fp8) for inner, cols in layer_gemm_shapes(model, t)]
    kernel = (eff.flash(hw.kernels.attention) if model.flash_attention
              else eff.gemm(hw.tensor_cores))  # dense: batched GEMMs over stored scores
    attention = tokens * model.attention_forward_flops_per_token / t / (kernel * hw.peak_flops)
    element = sum(element_bytes(model, layout, hw)) / (eff.elementwise * hw.hbm_bandwidth)
    return LayerTerms(sum(g.work for g in gemms), sum(g.waves for g in gemms), attention, element)


def layer_gemm_shapes(model: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(K, N) of the layer's four products on one tp rank: QKV, attention output, MLP in, MLP out; with
    experts the MLP's are one product of the width a token spans (k·f_e + f_s: the same FLOPs, not the
    per-expert products' wave quantization)."""
    h, d = model.hidden, model.head_dim
    inputs = 2 if model.arch == "llama" else 1  # SwiGLU's gate and up projections
    return [(h, (model.heads + 2 * model.kv_heads) * d / tp), (model.heads * d / tp, h),
            (h, inputs * model.token_ffn / tp), (model.token_ffn / tp, h)]


def compute(model: ModelSpec, layout: Layout, hw: Hardware) -> GpuCompute:
    eff = hw.efficiency
    layer = layer_terms(model, layout, hw)
    tokens = layout.mbs * model.seq / layout.cp
    bandwidth = eff.elementwise * hw.hbm_bandwidth
    selective = layer.attention + element_bytes(model, layout, hw)[1] / bandwidth
    flash = layer.attention if model.flash_attention else 0.0
    recompute = {"none": flash, "selective": selective, "full": layer.total,
                 "op": flash + (layer.gemm + layer.waves) / 2 + layer.element}[layout.recompute]
    element_b = sum(element_bytes(model, layout, hw, backward=True)) / bandwidth
    layer_b = 2 * (layer.gemm + layer.attention) + element_b + sum(
        backward_waves(tokens, inner, cols, hw, eff, hw.kernels.fp8)
        for inner, cols in layer_gemm_shapes(model, layout.tp))
    logits = gemm_terms(tokens, model.hidden, model.vocab / layout.tp, hw, eff)
    scale = hw.precision.activation_bytes / 2
    loss = hw.kernels.loss * scale * tokens * model.vocab / layout.tp / bandwidth
    ends_b = 2 * (logits.work + loss) + backward_waves(tokens, model.hidden, model.vocab / layout.tp, hw, eff)
    return GpuCompute(layer, layer_b, recompute, logits.total + loss, ends_b, layer.attention)
