"""What the composed-layout parity tests share (test_engine_layouts, test_compose_layouts, test_layout_matrix):
the tiny Llama configs, the float64 run settings, AdamW with the eps those tests need, the global batch."""

from __future__ import annotations

from typing import Any

import torch

from ndtrain.config import ModelConfig
from tests.helpers.models import token_batch

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-3
EPS = 1e-6  # see test_fsdp: with 1e-8 Adam turns 1e-7 summation-order noise on near-zero gradients into 1e-5 steps
MAX_NORM = 0.3  # below the model's gradient norms: clipping is exercised
MODEL = ModelConfig(preset="tiny", dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)

DTYPE = torch.float64  # of the reference and every layout but bf16/fp16 (see test_engine_layouts' docstring)
BF16_LOSS_TOLERANCE = 2e-2  # as test_precision: 10× bf16's rounding of the loss; weights are not compared

State = dict[str, torch.Tensor]


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, eps=EPS, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, GLOBAL_BATCH, SEQ)

# test_layout_matrix's model: 8 heads and kv heads (tp up to 8), 8 layers (pp up to 8; pp4 × vpp2 has a layer
# per chunk), sequence 16 (cp up to 8: the ring's 2·cp load-balanced halves)
MATRIX_MODEL = ModelConfig(preset="tiny", dim=32, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=64, seq_len=16)
