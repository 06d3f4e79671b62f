"""Tensor parallelism (Megatron-style): each large matrix of a layer is split over the tp group.

What is split, over the n ranks of `ctx.group("tp")` (activations batch-first, [B, T, ...]):
- `ColumnParallelLinear`: the weight's output features (rows of W [out, in]); rank r computes
  out/n output features from the whole input. With `blocks` > 1 the output is that many packed
  projections (GPT-2's fused q|k|v): rank r takes its 1/n of each block, never a split across one.
  Optional `gather_output` concatenates every rank's features back to the whole output
  (`colwise_gather_output`: the module after it sees the whole tensor, e.g. OLMo2's q_norm over all
  heads): one all-gather of b·s·out forward ((n−1)/n of it on the wire per rank), a slice backward.
- `RowParallelLinear`: the weight's input features (columns of W); rank r holds in/n input
  features (the column-parallel output) and produces a partial sum of the whole output, which is
  all-reduced (or, with sequence parallelism, reduce-scattered onto sequence shards). Optional
  `split_input` (`rowwise_split_input`) takes the whole input (a gathered column output, replicated
  work in between) and keeps this rank's slice: free forward, one all-gather of the input
  gradient b·s·in backward, on top of rowwise's cost.
Both also take a transposed linear (transformers' `Conv1D`: weight [in, out], y = x W + b), split
along the same features (`linear_parts`).
Both also take a `LoRALinear` (lora.py) and split its adapter with the base (`split_adapter`): the
adapter's output is added before the output's gather or reduction, its whole matrix's gradient
summed over tp (r·in or out·r elements per backward).
- `ReplicatedHeadsLinear`: grouped-query attention when n does not divide the kv heads: the whole
  k/v weight on every rank, each rank projecting only the heads its query heads read.

The conjugate communication operators, as autograd functions (named after Megatron's f and g):
    f  = `CopyToParallel`        forward identity,                 backward all-reduce
    g  = `ReduceFromParallel`    forward all-reduce,               backward identity
    ḡ  = `GatherSequence`        forward all-gather of dim 1 (T),  backward reduce-scatter
    ḡ* = `ScatterSequence`       forward reduce-scatter of dim 1,  backward all-gather
         `SplitSequence`       forward this rank's slice of dim 1, backward all-gather
         `GatherLastDim`         forward all-gather of dim −1,     backward slice
         `SplitLastDim`          forward this rank's slice of dim −1, backward all-gather
A column-parallel projection is preceded by f (or ḡ with sequence parallelism, which makes the
residual stream between blocks [B, T/n, d] per rank); a row-parallel one is followed by g (or
ḡ*). Projections that share one input (q, k, v; w1, w3) share one f / ḡ: `InputOp` is installed as
a forward pre-hook on their parent block, so the block's first input is communicated once.

Cost per column→row pair with input/output X = b·s·h elements: forward one all-reduce of X,
backward one all-reduce of X (2(n−1)/n · X each on the wire); with sequence parallelism the same
wire volume as all-gather + reduce-scatter ((n−1)/n · X each, twice per direction), and the
activations between blocks take 1/n of the memory. Weights and their gradients take 1/n.
Parameters replicated over tp whose gradient is partial on each rank (sequence-shard inputs,
replicated kv heads) get a gradient hook all-reducing it over tp (`sum_gradient_over`).
A sharded parameter's placement record (placement.py) holds its `Shard` (dim, start, length, padded
full size): what `is_tensor_parallel` reads, and what a checkpoint needs to place the shard in the full tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.errors import UserError
from ndtrain.parallel.model.lora import LoRA, LoRALinear
from ndtrain.parallel.placement import Shard, carry_placement

SEQ_DIM = 1


# --------------------------------------------------------------------------- conjugate operators
class CopyToParallel(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group)
        return grad, None, None


class ReduceFromParallel(torch.autograd.Function):
    """g: forward sums partial outputs over the group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def _token_dim(x: torch.Tensor) -> int:
    """The dim sequence parallelism splits: the sequence of [B, T, ...] activations, or the tokens of
    flattened [N, d] ones (an MoE block's shared expert): token-wise work needs only the same rows back."""
    return SEQ_DIM if x.ndim > 2 else 0


def _gather_seq(x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
    dim = _token_dim(x)
    shard = x.movedim(dim, 0).contiguous()
    full = shard.new_empty((group.size * shard.shape[0], *shard.shape[1:]))
    comm.all_gather(full, shard, group)
    return full.movedim(0, dim).contiguous()  # laid out as the unsplit module's output (fp32 reductions sum alike)


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    """UserError unless sequence parallelism can cut a sequence of `seq_len` tokens into tp shards."""
    if seq_len % tp:
        raise UserError(
            f"sequence length {seq_len} is not divisible by tp={tp}: "
            "sequence parallelism needs a multiple of tp (change seq_len or turn sequence_parallel off)"
        )


def _scatter_seq(x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
    dim = _token_dim(x)
    check_sequence_parallel(x.shape[dim], group.size)
    full = x.movedim(dim, 0).contiguous()
    shard = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    comm.reduce_scatter(shard, full, group)
    return shard.movedim(0, dim)


class GatherSequence(torch.autograd.Function):
    """ḡ: all-gather the sequence shards forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _gather_seq(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scatter_seq(grad, ctx.comm, ctx.group), None, None


class ScatterSequence(torch.autograd.Function):
    """ḡ*: reduce-scatter partial outputs onto sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _scatter_seq(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_seq(grad, ctx.comm, ctx.group), None, None


def _gather_last(x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
    shard = x.movedim(-1, 0).contiguous()
    full = shard.new_empty((group.size * shard.shape[0], *shard.shape[1:]))
    comm.all_gather(full, shard, group)
    return full.movedim(0, -1).contiguous()  # as the unsplit linear's output: a norm after it reduces alike


class GatherLastDim(torch.autograd.Function):
    """Concatenate every rank's last-dim slice forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.rank, ctx.width = group.rank, x.shape[-1]
        return _gather_last(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


class SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim of a tensor every rank holds whole; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        width = x.shape[-1] // group.size
        return x.narrow(-1, group.rank * width, width).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.comm, ctx.group), None, None


def gather_shard(value: torch.Tensor, shard: Shard, real: int, comm: Communicator, group: Group) -> torch.Tensor:
    """The whole tensor from every tp rank's slice `value` of it (`shard`: where the slice sits, its
    blocks put back in order), padding beyond the `real` size along the split dim cut away (collective
    over `group`)."""
    moved = value.movedim(shard.dim, -1).contiguous()
    full = GatherLastDim.apply(moved, comm, group)  # [..., rank, (block,) index]
    if shard.blocks > 1:
        full = full.unflatten(-1, (group.size, shard.blocks, -1)).transpose(-3, -2).flatten(-3)
    return full.movedim(-1, shard.dim).narrow(shard.dim, 0, real).clone()


def to_parallel(x: torch.Tensor, comm: Communicator, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel work: f, or ḡ when the input is a sequence shard."""
    op = GatherSequence if sequence_parallel else CopyToParallel
    return op.apply(x, comm, group)


def from_parallel(x: torch.Tensor, comm: Communicator, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The output of row-parallel work: g, or ḡ* onto sequence shards."""
    op = ScatterSequence if sequence_parallel else ReduceFromParallel
    return op.apply(x, comm, group)


class SplitSequence(torch.autograd.Function):
    """Keep this rank's sequence shard of a tensor every tp rank holds whole; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: Group) -> torch.Tensor:
        check_sequence_parallel(x.shape[SEQ_DIM], group.size)
        ctx.comm, ctx.group = comm, group
        length = x.shape[SEQ_DIM] // group.size
        return x.narrow(SEQ_DIM, group.rank * length, length).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_seq(grad, ctx.comm, ctx.group), None, None


class InputOp:
    """Forward pre-hook (registered `with_kwargs=True`) rewriting a module's input: its first
    positional argument, or the keyword `keyword` when it has none (Hugging Face calls attention
    with `hidden_states=`). `op(x, comm, group)` is applied to it: by default the input operator
    of column-parallel children sharing it (f, or ḡ with sequence parallelism)."""

    def __init__(
        self, comm: Communicator, group: Group, sequence_parallel: bool, keyword: str = "hidden_states",
        op: Any = None,
    ) -> None:
        self.comm, self.group, self.keyword = comm, group, keyword
        self.op = op or (GatherSequence if sequence_parallel else CopyToParallel)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (self.op.apply(args[0], self.comm, self.group), *args[1:]), kwargs
        if self.keyword not in kwargs:
            raise UserError(
                f"tensor parallel: {type(module).__name__} got neither a positional input nor {self.keyword}=: "
                "its column-parallel children cannot share an input"
            )
        return args, {**kwargs, self.keyword: self.op.apply(kwargs[self.keyword], self.comm, self.group)}


def sum_gradient_over(param: nn.Parameter, comm: Communicator, group: Group) -> None:
    """Make `param`'s gradient the sum of every tp rank's contribution, before it is accumulated
    (so gradient accumulation and DDP's hooks see complete gradients). A frozen parameter has none."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group)
        return grad

    if param.requires_grad:
        param.register_hook(hook)


# --------------------------------------------------------------------------- parallel layers
def _slice(
    t: torch.Tensor, dim: int, rank: int, parts: int, padded: int, blocks: int = 1,
) -> tuple[torch.Tensor, Shard]:
    """Rank `rank`'s part of `t` split in `parts` along `dim`, zero-padded to `padded` first; with
    `blocks` > 1 (no padding), its part of each of that many equal blocks of `dim`, concatenated."""
    size = t.shape[dim]
    if padded > size:
        pad = t.new_zeros((*t.shape[:dim], padded - size, *t.shape[dim + 1 :]))
        t = torch.cat([t, pad], dim=dim)
    length = padded // (parts * blocks)
    pieces = [t.detach().narrow(dim, b * padded // blocks + rank * length, length) for b in range(blocks)]
    return torch.cat(pieces, dim=dim).clone(), Shard(dim, rank * length, length * blocks, padded, blocks)


def linear_parts(module: nn.Module) -> tuple[bool, int, int] | None:
    """(transposed, in features, out features) of an `nn.Linear` (weight [out, in]) or of a transposed
    linear, transformers' `Conv1D` (GPT-2: weight [nx, nf], y = x W + b); None for any other module."""
    if type(module) in (nn.Linear, LoRALinear):
        return False, module.in_features, module.out_features
    nx, nf, weight = getattr(module, "nx", None), getattr(module, "nf", None), getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (nx, nf):
        return True, int(nx), int(nf)  # type: ignore[arg-type]
    return None


def _parts(module: nn.Module) -> tuple[bool, int, int]:
    parts = linear_parts(module)
    if parts is None:
        raise UserError(f"tensor parallel splits nn.Linear or Conv1D modules, not a {type(module).__name__}")
    return parts


def split_adapter(
    linear: nn.Module, by_output: bool, comm: Communicator, group: Group, padded: int, blocks: int = 1,
) -> LoRA | None:
    """`linear`'s LoRA adapter split as its base (lora.py): `by_output` B by the base's output rows
    (padded to `padded`, in `blocks`) and A whole, else A by the base's input columns and B whole;
    the whole matrix's gradient summed over tp. None for a layer without one."""
    if not isinstance(linear, LoRALinear):
        return None
    lora = linear.lora
    split, dim, whole = (lora.B, 0, lora.A) if by_output else (lora.A, 1, lora.B)
    part, shard = _slice(split, dim, group.rank, group.size, padded, blocks)
    sliced = carry_placement(nn.Parameter(part), split, tp=shard)
    kept = carry_placement(nn.Parameter(whole.detach().clone()), whole)
    sum_gradient_over(kept, comm, group)
    return lora.with_weights(kept, sliced) if by_output else lora.with_weights(sliced, kept)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵣᵀ (+ bᵣ): this rank's out/n output features (of each of `blocks` packed projections).
    `out_padded` ≥ out pads W with zero rows (a vocabulary padded to a multiple of n);
    `communicate_input=False` when the parent block applies the input operator (`InputOp`) once
    for several projections; `gather_output` returns the whole output on every rank."""

    def __init__(
        self, linear: nn.Module, comm: Communicator, group: Group, *, sequence_parallel: bool = False,
        gather_output: bool = False, communicate_input: bool = True, out_padded: int | None = None, blocks: int = 1,
    ) -> None:
        super().__init__()
        if gather_output and blocks > 1:
            raise UserError("tensor parallel: a packed projection's output cannot be gathered in order")
        self.comm, self.group = comm, group
        self.sequence_parallel, self.gather_output, self.communicate_input = (
            sequence_parallel, gather_output, communicate_input)
        self.transposed, self.in_features, self.out_features = _parts(linear)
        self.out_padded = out_padded or self.out_features
        weight, shard = _slice(linear.weight, int(self.transposed), group.rank, group.size, self.out_padded, blocks)
        self.weight = carry_placement(nn.Parameter(weight), linear.weight, tp=shard)
        self.bias = None
        if linear.bias is not None:
            bias, bias_shard = _slice(linear.bias, 0, group.rank, group.size, self.out_padded, blocks)
            self.bias = carry_placement(nn.Parameter(bias), linear.bias, tp=bias_shard)
        self.out_start = shard.start
        self.lora = split_adapter(linear, True, comm, group, self.out_padded, blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicate_input:
            x = to_parallel(x, self.comm, self.group, self.sequence_parallel)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        if self.lora is not None:
            y = y + self.lora(x)
        if self.gather_output:
            y = GatherLastDim.apply(y, self.comm, self.group)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (padded {self.out_padded}) / tp={self.group.size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = g(x_r W_rᵀ) (+ b): x_r is this rank's in/n input features (a column-parallel output, or
    with `split_input` this rank's slice of the whole input); the partial products are all-reduced,
    or reduce-scattered onto sequence shards. A bias is whole on every rank and added after the reduction."""

    def __init__(
        self, linear: nn.Module, comm: Communicator, group: Group, *, sequence_parallel: bool = False,
        split_input: bool = False,
    ) -> None:
        super().__init__()
        self.comm, self.group, self.sequence_parallel, self.split_input = comm, group, sequence_parallel, split_input
        self.transposed, self.in_features, self.out_features = _parts(linear)
        weight, shard = _slice(linear.weight, int(not self.transposed), group.rank, group.size, self.in_features)
        self.weight = carry_placement(nn.Parameter(weight), linear.weight, tp=shard)
        self.bias = None if linear.bias is None else carry_placement(nn.Parameter(linear.bias.detach().clone()), linear.bias)
        self.lora = split_adapter(linear, False, comm, group, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = SplitLastDim.apply(x, self.comm, self.group)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        if self.lora is not None:
            y = y + self.lora(x)  # partial sums joining the base's reduction
        y = from_parallel(y, self.comm, self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} / tp={self.group.size}, out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}, split_input={self.split_input}")


class ReplicatedHeadsLinear(nn.Module):
    """A k or v projection of grouped-query attention when tp does not divide the kv heads: the
    whole weight on every rank (initialised from the full layer), each rank projecting only rows
    [start, stop) — the kv heads its query heads read. Ranks sharing a head each hold part of its
    gradient, so the weight gradient is all-reduced over tp (the rows no rank reads stay zero)."""

    def __init__(self, linear: nn.Linear, comm: Communicator, group: Group, start: int, stop: int) -> None:
        super().__init__()
        if linear.bias is not None:
            raise UserError("a k/v projection with a bias cannot replicate kv heads over tp: make tp divide n_kv_heads")
        if isinstance(linear, LoRALinear):
            raise UserError("LoRA on a k/v projection whose heads are replicated over tp: make tp divide n_kv_heads "
                            "or leave it out of lora.targets")
        self.start, self.stop = start, stop
        self.weight = carry_placement(nn.Parameter(linear.weight.detach().clone()), linear.weight)
        sum_gradient_over(self.weight, comm, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[self.start : self.stop])

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.stop}) of {tuple(self.weight.shape)}, replicated over tp"
