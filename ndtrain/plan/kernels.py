"""Kernel profiles: the software stack a run's layers execute, as an input of the planner (`--kernels`).

A profile says which memory-bound element-wise kernels a transformer layer runs and how many bytes
each moves through HBM, and whether the linear layers' GEMMs run in FP8. The counts are read off
the stacks' code (per element of the tensor the op works on, forward pass, bf16 activations, an fp32
intermediate counting 4 bytes; a read and a write of one bf16 value = 4):

    op            eager                          fused (Megatron, TE)            compiled
    LayerNorm     4  native F.layer_norm         4  apex / TE fused kernel       4
    RMSNorm      36  written in PyTorch: .float() 4  fused kernel                 4  one inductor kernel
                     6, pow 8, mean 4, ·rsqrt 8,
                     .type_as 6, ·weight 4
    residual add  6  read 2, write 1 value       6  (bias-dropout-add fused)     6
    dropout      +5  own kernel: r, w, 1-byte    +1 fused into the add: the      +1
                     mask (hidden; scores too)      mask's byte (scores: +5, own kernel)
    GeLU          4  native F.gelu               4  fused bias-GeLU              4
    SwiGLU       10  silu 4 + product 6, per f   6  fused: read 2, write 1       6
    RoPE         20  complex: .float() 6, mul 8,  4  fused kernel                 4
                     .type_as 6, per q/k element
    scores       13  dense attention only: QKᵀ    8  fused scale-mask-softmax 4  8
                     writes 2, masked_fill 5,       (+ QKᵀ's write, AV's read)
                     softmax 4, AV reads 2
    loss         14  per logit: .float() 6,      38  vocab-parallel cross-entropy 14  (not compiled)
                     log_softmax 8                  on fp32: .float() 6, max 4, −max 8, exp 8, sum 4,
                                                    the softmax kept for the backward (÷ sum) 8
                                                    (Transformer Engine's Triton cross-entropy, which
                                                    Megatron-Bridge runs: 6, see published_megatron.py)
    FP8 cast      -  -                            3  fused-fp8 / compiled-fp8: each GEMM input read
                                                     in bf16, written in FP8 (read 2, write 1); in
                                                     the backward each GEMM's output gradient

Per token and layer on one tp rank (h' = h/t, or h without sequence parallelism; f' = f/t):
    element bytes = 2·norm·h' + 2·(residual + dropout)·h' + activation·f' + rope·(a+k)·d/t + cast·C
                    C (FP8 only): the values cast, forward the GEMM inputs 2h' + a·d/t + f',
                    backward the output gradients (a+2k)·d/t + 2h' + (2 for SwiGLU, else 1)·f'
    score bytes   = (scores + dropout)·a·s/t per token                          (dense attention only)
    loss bytes    = loss·V/t per token                                           (the last stage)
at η_ew of the HBM bandwidth (`efficiency.py`, one fitted constant for every stack); the backward
moves twice the forward's bytes. Values above are for 2-byte activations, scaled by β/2 otherwise.
Counting each op's own backward instead (1× its forward for a dropout mask or RoPE, 1.5× for GeLU,
2.5× for a two-pass norm backward, 2.6× for the eager RMSNorm's autograd chain, from the same
code) was tried on 2026-11-28 and raised the leave-one-source-out error (worst 27.8 → 33.0 %,
median 8.1 → 9.1 %; held out worst 18.5 → 20.2 %): the planner keeps the uniform 2×.
The fused attention kernel is the stack's too: PyTorch's (SDPA, FlashAttention, Triton: eager and
compiled) at η_attn, Transformer Engine's (cuDNN: fused) at η_attn,TE, each fitted.
A model has dropout when its spec says so (`ModelSpec.dropout`: gpt's Megatron practice of 0.1,
none for llama). An FP8 profile runs the four linear layers' GEMMs at the GPU's FP8 peak with 1-byte
operands (η_fp8, fitted); attention and the logits stay in bf16.

Which profile each published source ran is stated with its rows (`published_*.py`), from its code;
a source may differ from a named profile in one op (torchtitan's 2024 A100 runs: eager with a
fused RMSNorm), which its rows state. A calibrated CPU profile runs ndtrain's own eager code at
the element-wise rate `ndtrain plan --calibrate` measured (`cpu_profile.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ndtrain.errors import UserError


class LayerWidths(NamedTuple):
    """Values per token, on one tp rank, of the tensors a layer's element-wise kernels work on."""

    hidden: float  # h, or h/t with sequence parallelism
    ffn: float  # f/t: the MLP's activation
    qk: float  # (a + k)·d/t: the queries and keys the rotary embedding turns
    attention: float  # a·d/t: the attention output (the output projection's input)
    qkv: float  # (a + 2k)·d/t: the QKV product's output
    mlp_in: float  # f/t, or 2f/t for SwiGLU's gate and up: the MLP input product's output


@dataclass(frozen=True)
class KernelProfile:
    name: str
    stack: str  # what it stands for, in words
    layer_norm: float
    rms_norm: float
    residual: float
    dropout_hidden: float  # added to each residual add when the model has dropout
    gelu: float
    swiglu: float
    rope: float
    scores: float  # per score element of a dense (stored) attention matrix
    dropout_scores: float
    loss: float  # per logit element
    attention: str  # the fused attention kernel: "torch" (SDPA, FlashAttention, Triton) or "te" (TE / cuDNN)
    fp8: bool = False
    fp8_cast: float = 0.0  # per element cast: a linear layer's input, or in the backward its output gradient

    def layer_bytes_per_token(self, arch: str, widths: LayerWidths, dropout: bool, backward: bool = False) -> float:
        """Element-wise bytes of one layer per token (2-byte activations): the forward's, or the
        backward's (twice as many, the FP8 casts counted over the output gradients)."""
        norm = self.layer_norm if arch == "gpt" else self.rms_norm
        activation = self.gelu if arch == "gpt" else self.swiglu
        residual = self.residual + (self.dropout_hidden if dropout else 0.0)
        total = 2 * norm * widths.hidden + 2 * residual * widths.hidden + activation * widths.ffn
        if arch == "llama":
            total += self.rope * widths.qk
        if self.fp8:
            total += self.fp8_cast * (widths.qkv + 2 * widths.hidden + widths.mlp_in if backward
                                      else 2 * widths.hidden + widths.attention + widths.ffn)
        return 2 * total if backward else total

    def score_bytes(self, dropout: bool, backward: bool = False) -> float:
        """Bytes per score element of a dense attention's chain, forward (or backward: twice as many)."""
        forward = self.scores + (self.dropout_scores if dropout else 0.0)
        return 2 * forward if backward else forward


EAGER = KernelProfile(
    "eager", "PyTorch eager: each element-wise op its own kernel, attention by a fused kernel (SDPA, "
    "FlashAttention, Triton) or, for a dense model, as matmul + masked_fill + softmax",
    layer_norm=4, rms_norm=36, residual=6, dropout_hidden=5, gelu=4, swiglu=10, rope=20, scores=13,
    dropout_scores=5, loss=14, attention="torch")
FUSED = KernelProfile(
    "fused", "Megatron-LM's fusions (2020-09 on: fused LayerNorm, scale-mask-softmax, bias-GeLU, bias-dropout-add; "
    "Megatron-Core with Transformer Engine adds fused RMSNorm, RoPE, bias-SwiGLU and fused attention)",
    layer_norm=4, rms_norm=4, residual=6, dropout_hidden=1, gelu=4, swiglu=6, rope=4, scores=8,
    dropout_scores=5, loss=38, attention="te")
FUSED_FP8 = KernelProfile(
    "fused-fp8", "as fused, with Transformer Engine's FP8 GEMMs in the linear layers",
    layer_norm=4, rms_norm=4, residual=6, dropout_hidden=1, gelu=4, swiglu=6, rope=4, scores=8,
    dropout_scores=5, loss=38, attention="te", fp8=True, fp8_cast=3)
COMPILED = KernelProfile(
    "compiled", "torch.compile (inductor) of each layer: element-wise chains fused into single kernels, "
    "SDPA attention; the loss outside the compiled region",
    layer_norm=4, rms_norm=4, residual=6, dropout_hidden=1, gelu=4, swiglu=6, rope=4, scores=8,
    dropout_scores=5, loss=14, attention="torch")
COMPILED_FP8 = KernelProfile(
    "compiled-fp8", "as compiled, with torchao Float8 linear layers (dynamic tensorwise scaling)",
    layer_norm=4, rms_norm=4, residual=6, dropout_hidden=1, gelu=4, swiglu=6, rope=4, scores=8,
    dropout_scores=5, loss=14, attention="torch", fp8=True, fp8_cast=3)

PROFILES: dict[str, KernelProfile] = {p.name: p for p in (EAGER, FUSED, FUSED_FP8, COMPILED, COMPILED_FP8)}
DEFAULT = EAGER  # ndtrain's own layers on a GPU: eager PyTorch with SDPA attention


def profile(name: str) -> KernelProfile:
    if name not in PROFILES:
        raise UserError(f"--kernels {name!r} is unknown: choose one of {', '.join(PROFILES)}")
    return PROFILES[name]
