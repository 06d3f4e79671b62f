"""Seconds of one micro-batch's compute on a GPU, term by term, from datasheet numbers and the
universal efficiencies of `efficiency.py` (the same for every GPU; a CPU profile without layer
profiles uses the same terms with `efficiency.MEASURED`).

One layer's forward on one rank, T = b·s/c tokens, t tp, P peak FLOP/s, B HBM bytes/s, β bytes
per value:

gemm       the layer's four matrix products (QKV, attention output, MLP in, MLP out; SwiGLU's
           two input matrices are one product of width 2f/t), each of shape T×K times K×N:
               2·T·K·N / (η_mm·P)  +  β·(T·K + K·N + T·N) / B
           the arithmetic at the achievable fraction η_mm of peak, plus reading both operands
           and writing the result once from HBM (the roofline's memory side, added: a product
           of small K or N is memory-bound, and the more so the higher P/B, which is how the
           generation enters: P/B is 153 FLOP/byte on A100-80GB, 295 on H100 SXM)
attention  QKᵀ and AV, c·4·s·a·d·T/t FLOPs: flash attention (c = ½, causal) at η_attn·P, the
           fraction its fused kernel reaches; the dense kernel (c = 1) runs them as batched GEMMs
           at η_mm·P, its score matrix's traffic being element-wise work (below)
element    memory-bound element-wise work (norms, activation function, dropout, residual adds,
           softmax of a stored score matrix): e passes over the layer's activation bytes
           (`memory.layer_activation_bytes`), at B
Backward = 2 × forward, term by term (two products per forward product; the element-wise and
attention backward read and write twice as much). Recompute adds: full, one layer forward;
selective, the attention term (and, for a stored score matrix, its element-wise share); flash
attention always recomputes its scores in the backward (Dao 2022), so "none" adds the attention
term too. The model's ends on the last stage: the logits product T×h times h×V/t and the
cross-entropy's passes over the fp32 logits.
"""

from __future__ import annotations

from typing import NamedTuple

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.hardware import Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import activation_coefficients, layer_activation_bytes


class LayerTerms(NamedTuple):
    """Seconds of one layer forward on one rank, by term."""

    gemm: float
    attention: float
    element: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.element


class GpuCompute(NamedTuple):
    layer: LayerTerms  # forward of one layer
    recompute: float  # added to one layer's backward
    ends_f: float  # logits and loss forward (last stage)
    ends_b: float
    attention_f: float  # one layer's attention forward (what cp's ring hides behind)


def gemm_time(rows: float, inner: float, cols: float, hw: Hardware, eff: GpuEfficiency) -> float:
    beta = hw.precision.activation_bytes
    arithmetic = 2 * rows * inner * cols / (eff.matmul * hw.peak_flops)
    traffic = beta * (rows * inner + inner * cols + rows * cols) / hw.hbm_bandwidth
    return arithmetic + traffic


def layer_terms(model: ModelSpec, layout: Layout, hw: Hardware) -> LayerTerms:
    eff = hw.efficiency
    t = layout.tp
    tokens = layout.mbs * model.seq / layout.cp
    h, d = model.hidden, model.head_dim
    inputs = 2 if model.arch == "llama" else 1  # SwiGLU's gate and up projections
    gemm = (gemm_time(tokens, h, (model.heads + 2 * model.kv_heads) * d / t, hw, eff)
            + gemm_time(tokens, model.heads * d / t, h, hw, eff)
            + gemm_time(tokens, h, inputs * model.ffn / t, hw, eff)
            + gemm_time(tokens, model.ffn / t, h, hw, eff))
    kernel = eff.attention if model.flash_attention else eff.matmul  # dense: batched GEMMs over stored scores
    attention = tokens * model.attention_forward_flops_per_token / t / (kernel * hw.peak_flops)
    element = eff.element_passes * layer_activation_bytes(model, layout, hw.precision, "none") / hw.hbm_bandwidth
    return LayerTerms(gemm, attention, element)


def compute(model: ModelSpec, layout: Layout, hw: Hardware) -> GpuCompute:
    eff = hw.efficiency
    layer = layer_terms(model, layout, hw)
    beta = hw.precision.activation_bytes
    tokens = layout.mbs * model.seq / layout.cp
    scores = model.heads * tokens * model.seq * activation_coefficients(model, beta)[2] / layout.tp
    selective = layer.attention + eff.element_passes * scores / hw.hbm_bandwidth
    recompute = {"none": layer.attention if model.flash_attention else 0.0, "selective": selective,
                 "full": layer.total}[layout.recompute]
    logits = gemm_time(tokens, model.hidden, model.vocab / layout.tp, hw, eff)
    loss = eff.element_passes * 4 * tokens * model.vocab / layout.tp / hw.hbm_bandwidth  # fp32 logits
    return GpuCompute(layer, recompute, logits + loss, 2 * (logits + loss), layer.attention)
