"""LoRA (Hu et al. 2021): low-rank adapters on the linear layers a run names, the rest of the model frozen.

What is added: each target `nn.Linear` (weight W [out, in]) becomes a `LoRALinear` keeping W and its
bias frozen under their names, with an adapter `lora` of two trainable matrices A [r, in]
(kaiming-uniform with a = √5, as nn.Linear's and peft's) and B [out, r] (zeros, so training starts
from the base model), computing y = x Wᵀ + b + dropout(x) Aᵀ Bᵀ · α/r. Every other parameter is
frozen (requires_grad=False): it holds no gradient and no optimizer state under any strategy.
Trainable parameters Σ r·(in + out) over the targets, AdamW state twice that; the frozen base
costs its parameter bytes only.

The adapters are drawn in the whole model before any parallelism, each from a generator seeded by
(seed, target name): every layout starts from the same weights. Tensor parallel splits an adapter
with its base layer (tensor.py `split_adapter`): a column-parallel base (W by output rows) takes B
by the same rows and A whole, a row-parallel base (W by input columns) takes A by the same columns
and B whole, and the adapter's partial output joins the base's one all-reduce (or reduce-scatter).
The whole matrix's gradient is then partial on each rank (A sees only this rank's output features,
B only its partial input): a hook sums it over tp, one all-reduce of r·in (column) or out·r (row)
elements per target and backward; nothing more forward. Dropout would draw different masks on the
tp ranks that share an input, so the config refuses it under tp (config/train.py).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.errors import UserError


class LoRA(nn.Module):
    """The adapter: x ↦ dropout(x) Aᵀ Bᵀ · alpha/r (A [r, in], B [out, r], or a tp rank's slice of either)."""

    def __init__(self, a: nn.Parameter, b: nn.Parameter, alpha: float, dropout: float) -> None:
        super().__init__()
        self.A, self.B = a, b
        self.r, self.alpha = a.shape[0], alpha
        self.scaling = alpha / self.r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scaling

    def with_weights(self, a: nn.Parameter, b: nn.Parameter) -> LoRA:
        """The same adapter over other matrices (a tp rank's slices)."""
        return LoRA(a, b, self.alpha, self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0)

    def delta(self) -> torch.Tensor:
        """B A · alpha/r [out, in]: what merging adds to the base weight."""
        return (self.B @ self.A) * self.scaling

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


class LoRALinear(nn.Linear):
    """A frozen `nn.Linear` (same `weight` and `bias`) plus its trainable adapter `lora`."""

    def __init__(self, linear: nn.Linear, lora: LoRA) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora(x)

    def merged(self) -> torch.Tensor:
        """W + B A · alpha/r."""
        return self.weight.detach() + self.lora.delta().to(self.weight.dtype)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _adapter(name: str, linear: nn.Linear, r: int, alpha: float, dropout: float, seed: int) -> LoRA:
    """A kaiming-uniform (a = √5: bound 1/√in) and B zeros, drawn from (seed, name) on the CPU."""
    weight = linear.weight
    bound = 1.0 / math.sqrt(linear.in_features)
    a = torch.empty(r, linear.in_features, dtype=weight.dtype).uniform_(-bound, bound, generator=_generator(seed, name))
    b = torch.zeros(linear.out_features, r, dtype=weight.dtype)
    return LoRA(nn.Parameter(a.to(weight.device)), nn.Parameter(b.to(weight.device)), alpha, dropout)


def apply_lora(model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float, seed: int) -> nn.Module:
    """Freeze `model` and give every `nn.Linear` whose name ends in one of `targets` (a whole name
    component: "wq" matches "layers.0.attention.wq") an adapter of rank `r`, in place; returns it.
    A target matching no linear layer is one line naming those that exist."""
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    matched = {t: [n for n in linears if n == t or n.endswith("." + t)] for t in targets}
    missing = [t for t, names in matched.items() if not names]
    if missing:
        suffixes = sorted({n.rpartition(".")[2] for n in linears})
        raise UserError(f"lora.targets {missing} match no nn.Linear of {type(model).__name__}: its linear layers end in "
                        f"{', '.join(suffixes) or 'nothing'}")
    for param in model.parameters():
        param.requires_grad_(False)
    for name in sorted({n for names in matched.values() for n in names}):
        parent_name, _, child = name.rpartition(".")
        linear = linears[name]
        setattr(model.get_submodule(parent_name), child, LoRALinear(linear, _adapter(name, linear, r, alpha, dropout, seed)))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's adapted layers by module name (empty without LoRA)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoRALinear` of the whole (single-process) `model` by a plain `nn.Linear` of weight
    W + B A · alpha/r, in place; returns it (what a checkpoint without adapters would hold)."""
    for name, layer in lora_layers(model).items():
        parent_name, _, child = name.rpartition(".")
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           device=layer.weight.device, dtype=layer.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(layer.merged())
            if layer.bias is not None:
                linear.bias.copy_(layer.bias)
        setattr(model.get_submodule(parent_name), child, linear)
    return model


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every adapter merged into its base weight and its own entries gone:
    the state of the model without LoRA that computes the same (`model` is left as it is)."""
    state = model.state_dict()
    for name, layer in lora_layers(model).items():
        state[f"{name}.weight"] = layer.merged()
        for key in (f"{name}.lora.A", f"{name}.lora.B"):
            del state[key]
    return state
