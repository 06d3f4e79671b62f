"""The compute part of a CPU profile for one model: measured seconds of its pieces, per tp shard.

`ndtrain plan --calibrate --model PRESET` (or `--arch llama ...`) adds to the machine profile what
one process of this machine takes to run the model's pieces, the way Alpa and Galvatron profile
a model's layers before planning it: FLOP counts cannot say what a CPU achieves on small,
memory-bound shapes (norms, SwiGLU, attention softmax, cross-entropy, autograd), so the planner
uses these times instead of FLOPs ÷ matmul rate whenever the profile holds them.

Measured, for every tp that divides the query heads and is ≤ the largest planned process count,
and micro-batch sizes `MICRO_BATCHES`, forward and backward (autograd) separately, median over
repeats, through a stack of the model's l blocks with their own weights (per block = stack ÷ l:
weights stream through the caches as in a step; one block repeated would run from warm caches), with `threads` intra-op threads in each of `concurrency` processes running at once (so
the measurement shares caches and memory bandwidth as the planned processes do):
    layer   one Llama block on tp rank 0's shard: RMSNorm, q/k/v projections with a/t query heads
            and k/t key/value heads (when t does not divide k, the one kv head its query heads
            share: ndtrain's tp_plan replicates it), rotary, causal SDPA, output projection, residual, RMSNorm, SwiGLU with f/t,
            residual — the ops of ndtrain's `Block` at the shard's shapes; its backward also split as
            zero-bubble's runner splits it (split_backward.py): the input pass I (`autograd.grad` to
            the input, the weight products skipped) and the weight passes W (one autograd call per
            weight-consuming node), each timed after the forward (and W after I) as (f + I) − f and
            (f + I + W) − (f + I)
    head    the embedding lookup of V/t rows, the final RMSNorm, the logits x·W (h × V/t) and the
            cross-entropy over them (the vocabulary-parallel ends of the first and last stage)
    adamw   the per-step work over the parameters, seconds per element: what Engine.train_step does after
            the backward (the gradient's norm, `grad_norm.local_squares`, and its clip, `grad_norm.clip_`),
            torch.optim.AdamW (foreach) and zeroing the gradients, on tensors shaped as the model's (its
            ends and whole blocks, ≥ 4 M elements: the per-tensor overhead counts as in a step)
Only llama models (ndtrain's family) are profiled (`cpu_profile.profiled_tps` refuses others).
No collective runs here: tp communication is priced by the collectives part of the profile.
Imported only inside calibration workers (it needs torch; the planner itself does not).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ndtrain.models.llama import Attention, apply_rotary, rotary_tables
from ndtrain.parallel.grad_norm import clip_, local_squares
from ndtrain.parallel.pipeline.split_backward import WeightPasses
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.cpu_profile import shard_key

MICRO_BATCHES = (1, 2)
ADAMW_ELEMENTS = 4 * 1024**2


def measure(model: ModelSpec, tps: list[int], timed: Callable[[Callable[[], None]], float]) -> dict[str, dict[str, float]]:
    """Seconds of each piece for every (tp, mbs); `timed(fn)` returns the median seconds of fn().
    Forward is timed with autograd recording (as in training); backward = (forward + backward) − forward."""
    torch.manual_seed(0)
    result: dict[str, dict[str, float]] = {}
    for tp in tps:
        for mbs in MICRO_BATCHES:
            shard, n = Shard(model, tp, mbs, model.layers), model.layers
            stack_f, stack_fb = timed(shard.stack), timed(lambda: shard.stack().sum().backward())
            stack_fi, stack_fiw = timed(lambda: shard.split_backward(False)), timed(lambda: shard.split_backward(True))
            head_f, head_fb = timed(shard.head), timed(lambda: shard.head().backward())
            result[shard_key(tp, mbs)] = {"layer_f": stack_f / n, "layer_b": max(stack_fb - stack_f, 0.0) / n,
                                          "head_f": head_f, "head_b": max(head_fb - head_f, 0.0),
                                          "layer_i": max(stack_fi - stack_f, 0.0) / n,
                                          "layer_w": max(stack_fiw - stack_fi, 0.0) / n}
    params = _step_parameters(model)
    step = _step_passes(params, torch.optim.AdamW(params, lr=1e-4, foreach=True))
    result["adamw"] = {"s_per_param": timed(step) / sum(p.numel() for p in params)}
    return result


def _step_passes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Engine.train_step's work after the backward, over `params`' gradients: their global norm
    (grad_norm.local_squares), the clip (grad_norm.clip_), the optimizer step, and the zeroing of the
    gradients before the next step (one write of each; they stay allocated, as in ndtrain's buckets)."""
    grads = [p.grad for p in params]

    def step() -> None:
        clip_(grads, local_squares([(g, 1.0) for g in grads], grads[0].device).sqrt(), 1.0)
        optimizer.step()
        torch._foreach_zero_(grads)

    return step


def _step_parameters(model: ModelSpec) -> list[torch.Tensor]:
    """Parameters shaped as the model's (its ends, then whole blocks until `ADAMW_ELEMENTS`), each with a
    gradient: the optimizer's per-tensor overhead counts as in a step, not only its bytes."""
    h, d, f = model.hidden, model.head_dim, model.ffn
    block = [(model.heads * d, h), (model.kv_heads * d, h), (model.kv_heads * d, h), (h, model.heads * d),
             (f, h), (f, h), (h, f), (h,), (h,)]
    shapes: list[tuple[int, ...]] = [(model.vocab, h), (model.vocab, h), (h,), *block]
    while sum(math.prod(shape) for shape in shapes) < ADAMW_ELEMENTS:
        shapes += block
    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


class Shard:
    """tp rank 0's share of `blocks` Llama blocks (each its own weights) and of the model's ends, for
    one micro-batch."""

    def __init__(self, model: ModelSpec, tp: int, mbs: int, blocks: int = 1) -> None:
        h, d, s = model.hidden, model.head_dim, model.seq
        self.heads = model.heads // tp
        self.kv = model.kv_heads // tp if model.kv_heads % tp == 0 else 1
        self.d, self.shape = d, (mbs, s, h)
        ffn, vocab = model.ffn // tp, math.ceil(model.vocab / tp)
        self.weights = [
            {"wq": _weight(self.heads * d, h), "wk": _weight(self.kv * d, h), "wv": _weight(self.kv * d, h),
             "wo": _weight(h, self.heads * d), "w1": _weight(ffn, h), "w3": _weight(ffn, h), "w2": _weight(h, ffn),
             "norms": [torch.ones(h, requires_grad=True) for _ in range(2)]}
            for _ in range(blocks)
        ]
        self.final_norm = torch.ones(h, requires_grad=True)
        self.embedding, self.output = _weight(vocab, h), _weight(vocab, h)
        self.tokens = torch.randint(0, vocab, (mbs, s))
        self.targets = torch.randint(0, vocab, (mbs, s))
        self.cos, self.sin = rotary_tables(torch.arange(s), d, 10000.0)
        self.x = torch.randn(*self.shape, requires_grad=True)
        self.grad_out = torch.randn(*self.shape)

    def stack(self) -> torch.Tensor:
        """Every block in turn: each block's weights are read once per pass, as in a training step
        (a single block called again and again would run from warm caches)."""
        x = self.x
        for i in range(len(self.weights)):
            x = self.layer(i, x)
        return x

    def block_parameters(self) -> list[torch.Tensor]:
        """The blocks' weights and norm weights (not the ends'), block by block."""
        return [p for w in self.weights for p in (*(w[name] for name in _MATRICES), *w["norms"])]

    def split_backward(self, weights: bool) -> None:
        """The stack's forward, then zero-bubble's input pass, then (`weights`) its weight passes, as the
        pipeline runner runs I and W on a stage that is not the first."""
        out = self.stack()
        params = self.block_parameters()
        passes = WeightPasses(out, params)
        torch.autograd.grad(out, [self.x], self.grad_out, retain_graph=True)
        passes.input_pass_done()
        if not weights:
            return
        if passes.complete:
            passes.run()
        else:  # the runner's fallback: one walk of the whole graph to the weights
            torch.autograd.backward(out, self.grad_out, inputs=params)

    def layer(self, i: int = 0, x: torch.Tensor | None = None) -> torch.Tensor:
        """The ops of ndtrain's `Block.forward` (models/llama.py) at the shard's shapes, block i."""
        b, s, _ = self.shape
        w = self.weights[i]
        x = self.x if x is None else x
        y = F.rms_norm(x, (x.shape[-1],), eps=1e-5) * w["norms"][0]
        q, k, v = (F.linear(y, w[name]).view(b, s, -1, self.d).transpose(1, 2) for name in ("wq", "wk", "wv"))
        q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        attention = Attention.attend(q, k, v)
        x = x + F.linear(attention.transpose(1, 2).reshape(b, s, -1), w["wo"])
        y = F.rms_norm(x, (x.shape[-1],), eps=1e-5) * w["norms"][1]
        return x + F.linear(F.silu(F.linear(y, w["w1"])) * F.linear(y, w["w3"]), w["w2"])

    def head(self) -> torch.Tensor:
        x = F.embedding(self.tokens, self.embedding) + self.x
        logits = F.linear(F.rms_norm(x, (x.shape[-1],), eps=1e-5) * self.final_norm, self.output)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), self.targets.view(-1))


_MATRICES = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def _weight(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols) * 0.02).requires_grad_()
