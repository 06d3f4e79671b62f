"""The MoE router's load-balancing loss in the training loss, as the model's own forward adds it, under every layout.

What transformers does (Mixtral, Qwen2-MoE, Qwen3-MoE and the other families whose `*ForCausalLM.forward`
calls `load_balancing_loss_func`): with `config.output_router_logits` true and labels given, the loss is
cross-entropy + `router_aux_loss_coef` · aux, where over the router logits of ALL layers and ALL tokens of
the forward (E experts, top-k routing, N = layers × tokens rows)

    aux = E · Σ_e f_e · P_e,   f_e = C_e / N (C_e: the rows whose top-k chose e; no gradient),
                               P_e = p_e / N (p_e: the sum of e's softmax probability; the gradient),

accumulated in float32 whatever the model's dtype (as transformers does; ndtrain does the same, so the
single-process loss equals the model's own). It is a product of means, not a sum over layers or tokens,
but since C carries no gradient it is linear in p once C and N are global: a rank holding some of the
rows adds its share E · Σ_e (C_e/N) · (p_e/N) and the shares add up to aux.

Collection: a forward hook on every router module (the class transformers records `router_logits` from,
`_can_record_outputs`) keeps its logits while a window is open: the adapter's forward (`CausalLM`) or a
pipeline stage's. A recomputation in backward (`recompute`) runs the routers again outside any window and
is ignored. The hooks only keep the tensor; all arithmetic happens after the forward.

Layouts (one micro-batch is one forward, as in the reference: the mean of the pieces' losses):
- dp, ZeRO-1/2/3: each rank's micro-batch is its own forward; nothing is exchanged.
- cp, and tp with sequence parallelism when the routers see 1/tp of the tokens (their row count against
  the forward's targets says so): the ranks hold disjoint tokens of one forward. One all-reduce of
  (C, p, N), 2E+1 float32, per such group and forward; each rank's loss gets the global aux as its
  value and its own share's gradient, × cp because the data-parallel strategy averages gradients over
  dp×cp (tp sums a replicated parameter's gradient under sequence parallelism: × 1). Routers that see
  every token (tp without sequence parallelism) compute the whole aux on every tp rank, their gradient
  identical (parallel/model/moe.py keeps the router outside the experts' f): nothing exchanged.
- pp: the stats of a stage's layers travel with its activation to the next stage (`RouterLoss.attach_to_stage`:
  (C, p, N) and a pad, 2E+2 float32, appended bit for bit to the flattened activation, 8·(E+1) bytes more per
  boundary and micro-batch, the same back with the gradient; one copy of the activation on each side); the
  last stage adds the loss (with the all-reduces above), and the gradient of the earlier stages' p comes
  back in the activation's gradient. No extra message.
Whether the routers saw a 1/tp share is read from shapes (Python ints): no host synchronisation.
Only the training loss (the model in train mode) gets the term: evaluation (`Engine.evaluate`, eval mode)
reports the cross-entropy alone, the nats per token its unit says (transformers' forward would add the
term there too).
With `Engine(loss_fn=...)` the user's loss replaces the model's, router term included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.mesh import ParallelContext
from ndtrain.errors import UserError
from ndtrain.models.hf_parallel import HFParallel
from ndtrain.parallel.model.context import Ring
from ndtrain.parallel.model_spec import Heads, LossFn


@dataclass(frozen=True)
class TokenGroup:
    """Ranks whose routers see disjoint tokens of one forward: their counts and probability sums add up.
    `grad_scale`: what a rank's share is multiplied by for the gradient (the strategy averages, ×size, or
    sums, ×1, these ranks' gradients); `sharded_only`: the group applies only when the routers saw
    1/size of the forward's tokens (sequence parallelism over tp)."""

    comm: Communicator
    group: Group
    grad_scale: int
    sharded_only: bool


@dataclass
class RouterStats:
    """One forward's router statistics so far, float32: top-k counts C [E], probability sums p [E] (with
    gradient), rows N []."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def flat(self) -> torch.Tensor:
        """[C, p, N, 0]: 2E+2 float32 (an even count: whole float64 elements when packed)."""
        return torch.cat([self.counts, self.probs, self.rows.view(1), self.rows.new_zeros(1)])

    @staticmethod
    def of_flat(flat: torch.Tensor) -> RouterStats:
        experts = (flat.numel() - 2) // 2
        counts, probs, rows, _ = flat.split([experts, experts, 1, 1])
        return RouterStats(counts.detach(), probs, rows.detach()[0])


class _Window:
    """The router logits recorded during one forward, on top of the stats carried from earlier stages;
    `rows_per_layer`: the tokens each router layer of this rank sees (a Python int: read without a sync)."""

    def __init__(self, experts: int, top_k: int, carried: RouterStats | None = None,
                 rows_per_layer: int | None = None) -> None:
        self.experts, self.top_k, self.carried, self.rows_per_layer = experts, top_k, carried, rows_per_layer
        self.logits: list[torch.Tensor] = []

    def record(self, logits: torch.Tensor) -> None:
        self.logits.append(logits)
        self.rows_per_layer = logits.shape[0]

    def stats(self, device: torch.device) -> RouterStats:
        """C, p, N as transformers' `load_balancing_loss_func` accumulates them (no attention mask),
        layer after layer, from zeros or from the carried stats."""
        if self.carried is None:
            zeros = torch.zeros(self.experts, dtype=torch.float32, device=device)
            stats = RouterStats(zeros, zeros, zeros.new_zeros(()))
        else:
            stats = self.carried
        counts, probs, rows = stats.counts, stats.probs, stats.rows
        for logits in self.logits:
            weights = torch.softmax(logits, dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            chosen = selected.reshape(-1)
            ones = torch.ones(chosen.shape, dtype=torch.float32, device=device)
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, ones)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        return RouterStats(counts, probs, rows)


class RouterLoss:
    """`router_aux_loss_coef` · aux of an HF MoE causal LM (`hf`), collected by hooks on its routers."""

    def __init__(self, routers: Sequence[nn.Module], index: int, experts: int, top_k: int, coef: float,
                 hidden_size: int) -> None:
        self.experts, self.top_k, self.coef, self.hidden_size = experts, top_k, coef, hidden_size
        self._index = index
        self._window: _Window | None = None
        self._groups: dict[str, TokenGroup] = {}
        for router in routers:
            router.register_forward_hook(self._record)

    @staticmethod
    def of(hf: nn.Module) -> RouterLoss | None:
        """The loss `hf`'s forward adds with labels, or None (output_router_logits false, coefficient 0).
        A model that would add one ndtrain cannot find the routers of is refused in one line."""
        config = hf.config
        coef = getattr(hf, "router_aux_loss_coef", 0.0)
        if not getattr(config, "output_router_logits", False) or not coef:
            return None
        specs = getattr(hf, "_can_record_outputs", None) or {}
        spec = specs.get("router_logits")
        spec = spec[0] if isinstance(spec, list) else spec
        target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
        experts, top_k = getattr(hf, "num_experts", None), getattr(hf, "num_experts_per_tok", None)
        routers = [m for m in hf.modules() if target is not None and isinstance(m, target)]
        if not routers or not experts or not top_k:
            raise UserError(f"{config.model_type}: output_router_logits=true adds a router loss ndtrain cannot "
                            "reproduce (no recorded router class, num_experts or num_experts_per_tok on the model): "
                            "set output_router_logits=false in the model config")
        return RouterLoss(routers, getattr(spec, "index", 0), int(experts), int(top_k), float(coef),
                          int(config.hidden_size))

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._window is not None:
            self._window.record(output[self._index] if isinstance(output, tuple) else output)

    def spread_over(self, axis: str, group: TokenGroup) -> None:
        """The ranks of `axis` hold disjoint tokens of each forward (context parallel; tp's sequence shards)."""
        self._groups[axis] = group

    @contextlib.contextmanager
    def window(self) -> Iterator[_Window]:
        """Record the routers' logits while open."""
        self._window = window = _Window(self.experts, self.top_k)
        try:
            yield window
        finally:
            self._window = None

    def loss(self, window: _Window, tokens: int, device: torch.device) -> torch.Tensor:
        """coef · aux of the forward `window` recorded, whose `tokens` targets this rank holds: the global
        value, this rank's share of the gradient (× the strategy's averaging)."""
        stats = window.stats(device)
        assert window.rows_per_layer is not None, "a whole forward runs at least one router"
        groups = [g for g in self._groups.values() if g.group.size > 1 and _splits(g, window.rows_per_layer, tokens)]
        if not groups:
            return self.coef * self._aux(stats.counts, stats.probs, stats.rows)
        total = torch.cat([stats.counts, stats.probs.detach(), stats.rows.view(1)])
        for g in groups:
            g.comm.all_reduce(total, g.group)
        counts, probs, rows = total.split([self.experts, self.experts, 1])
        share = math.prod(g.grad_scale for g in groups) * self._aux(counts, stats.probs, rows[0])
        return self.coef * (share + (self._aux(counts, probs, rows[0]) - share).detach())

    def _aux(self, counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """E · Σ_e (C_e/N)·(p_e/N), in the order of transformers' expression."""
        return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * self.experts

    # ------------------------------------------------------------------ pipeline stages
    def attach_to_stage(self, stage: nn.Module, first: bool, last: bool) -> None:
        """Carry the stats through a pipeline stage `stage(x, targets, positions)`: unpack them from the
        incoming activation (not first), pack them onto the outgoing one (not last), add the loss (last)."""
        stage.register_forward_pre_hook(lambda module, args, kwargs: self._enter(first, args, kwargs), with_kwargs=True)
        stage.register_forward_hook(
            lambda module, args, kwargs, output: self._leave(last, module.training, args, kwargs, output),
            with_kwargs=True)

    def _enter(self, first: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._window = _Window(self.experts, self.top_k)
        if not first:  # each router layer here sees the incoming activation's tokens
            targets = args[1] if len(args) > 1 else kwargs["targets"]
            hidden, flat = _Unpack.apply(args[0], 2 * self.experts + 2, targets.shape[0], self.hidden_size)
            rows = hidden.shape[0] * hidden.shape[1]
            self._window = _Window(self.experts, self.top_k, RouterStats.of_flat(flat), rows)
            args = (hidden, *args[1:])
        return args, kwargs

    def _leave(self, last: bool, training: bool, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        window, self._window = self._window, None
        assert window is not None, "a pipeline stage left without entering"
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        if not last:
            return _Pack.apply(output, window.stats(output.device).flat())
        if targets is None or not training:
            return output
        return output + self.loss(window, targets.numel(), output.device)


def _splits(group: TokenGroup, rows_per_layer: int, tokens: int) -> bool:
    """Whether `group`'s ranks saw disjoint tokens of the forward: always (cp), or when each router layer
    of this rank saw 1/size of the `tokens` (sequence parallelism over tp); all of them: no."""
    if not group.sharded_only or rows_per_layer * group.group.size == tokens:
        return True
    if rows_per_layer == tokens:
        return False
    raise RuntimeError(f"the routers saw {rows_per_layer} rows of a forward of {tokens} tokens over "
                       f"{group.group.size} ranks: neither all nor 1/{group.group.size} of them")


class _Pack(torch.autograd.Function):
    """hidden [..] and float32 stats [S] → one flat tensor of hidden's dtype, the stats' bytes at its end."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shape = hidden.shape
        return torch.cat([hidden.reshape(-1), stats.contiguous().view(torch.uint8).view(hidden.dtype)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        n = math.prod(ctx.shape)
        return grad[:n].view(ctx.shape), grad[n:].contiguous().view(torch.uint8).view(torch.float32)


class _Unpack(torch.autograd.Function):
    """The inverse of `_Pack`: hidden [B, -1, d] and the float32 stats (S of them), bit for bit both ways."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, packed: torch.Tensor, size: int, batch: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tail = size * 4 // packed.element_size()
        ctx.dtype, ctx.n = packed.dtype, packed.numel() - tail
        hidden = packed[: ctx.n].view(batch, -1, width).clone()
        return hidden, packed[ctx.n :].contiguous().view(torch.uint8).view(torch.float32).clone()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_hidden: torch.Tensor, grad_stats: torch.Tensor
    ) -> tuple[Any, ...]:
        """(Undefined gradients arrive as zeros: autograd materialises them for custom functions.)"""
        tail = grad_stats.contiguous().view(torch.uint8).view(ctx.dtype)
        return torch.cat([grad_hidden.reshape(-1), tail]), None, None, None


class RoutedParallel(HFParallel):
    """The spec of a `CausalLM` whose model adds a router loss: its family's (`HFParallel`), which also tells
    the loss which ranks share a forward's tokens (tp, cp) and carries it through pipeline stages."""

    def __init__(self, model: nn.Module, router_loss: RouterLoss) -> None:
        super().__init__(model)
        self.router_loss = router_loss

    def fit_tensor_parallel(self, ctx: ParallelContext, heads: Heads | None) -> None:
        super().fit_tensor_parallel(ctx, heads)
        self.router_loss.spread_over("tp", TokenGroup(ctx.comm, ctx.group("tp"), grad_scale=1, sharded_only=True))

    def context_parallel(self, ring: Ring) -> nn.Module | None:
        routed = super().context_parallel(ring)
        cp = ring.group.size
        self.router_loss.spread_over("cp", TokenGroup(ring.comm, ring.group, grad_scale=cp, sharded_only=False))
        return routed

    def pipeline_stage(self, block_ids: Sequence[int], first: bool, last: bool, loss_fn: LossFn | None) -> nn.Module:
        stage = super().pipeline_stage(block_ids, first, last, loss_fn)
        if loss_fn is None:  # an Engine loss_fn replaces the model's own loss, router term included
            self.router_loss.attach_to_stage(stage, first, last)
        return stage
