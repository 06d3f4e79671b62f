"""The one executor of pipeline schedules: runs this rank's action list for one training step
(`run_pipeline`), or only the forwards, chunk by chunk, for evaluation (`eval_pipeline`: any m,
under no_grad, nothing kept).

What is communicated, and when (all through `ctx.comm.batch_send_recv` on the pp group):
- SEND_F / RECV_F: the activation leaving a stage for the next one, [b, T, d] per micro-batch;
  SEND_B / RECV_B: the gradient of that activation, same shape, coming back. Per step and stage
  boundary: m activations forward and m gradients backward, 2·m·b·T·d elements.
- Shapes and dtypes are never configured: the first activation crossing each boundary in a step
  is preceded by a 10-element int64 header (dtype, ndim, sizes); a gradient has the shape of the
  activation it belongs to, which its receiver sent.
- Ordering: sends are posted asynchronously right after the producing action. Receives from a
  peer are posted in that peer's sending order (every rank can compute it: schedules are pure
  functions of (p, m, v)): when one is needed, it and every earlier one are posted; once it has
  arrived, the next one is posted ahead (one buffer per peer) so its transfer overlaps compute.
  Messages of a pair of ranks are thus always matched in order; a valid schedule cannot deadlock.
- After the schedule: the tied embedding/head gradient is exchanged between the first and last
  stage (V·d elements each way; sharded gradients first gather it over dp×cp, tied_shards.py) and
  the loss is broadcast from the last stage (one scalar).

Context parallel (cp > 1): the micro-batches are this cp rank's sequence shards with their global
positions (`shard_sequence`), which every stage passes to its rotary tables; activations crossing a
boundary are [b, T/cp, d], and each stage's attention runs its ring over the cp group (all members
of a cp group hold the same stage and run the same action list, so their ring exchanges match).

Loss and gradients: micro-batch i's loss is scaled by the engine's weight w_i (its share of the
global batch's targets, parallel/target_mean.py; 1/m without weights) and by fp16's loss scale S
(applied on the last stage, it reaches every stage through the gradients sent back) before its
backward, so the gradients accumulated into `.grad` (never zeroed here) are those of the weighted
sum, as in single-process gradient accumulation. A micro-batch's activations are dropped at its backward
(its weight pass W under zb), so the live count follows the schedule: m for gpipe, ≤ p for 1f1b.

Split backward (zb): I computes the stage input's gradient only, W the weight gradients from the
gradients I left at each weight's operation (`split_backward`): together about one full backward.
Stage 0 has no input gradient: its I is free, its W the whole backward. Sent tensors are kept
until the end of the step (a c10d send needs its buffer until done).

Data parallel: the runner never asks what wraps a stage; it is handed one `StageHooks` per chunk
(hooks.py, from the strategy: `DataParallelStrategy.stage_hooks`) and only calls them. A chunk whose
hooks have `no_sync` (DDP, ZeRO-1: gradients accumulate locally) synchronises only in its last
gradient-producing action of the step (the others run under `no_sync()`): the usual 2(N−1)/N·G per
step, once, overlapped with that last backward only. A tied embedding/head weight with data
parallel: each copy is averaged over dp first, then the two are summed across the pipeline (linear,
so exact). A chunk whose gradients are sharded (`gradients_sharded`: ZeRO-2, ZeRO-3) has no
`no_sync`: each micro-batch's backward reduces its gradient into the shard, so the gradients stay
sharded while several forwards wait for their backwards (FSDP pairs each backward with the oldest
waiting forward: every schedule runs a chunk's backwards, and zb its W passes, in its forwards'
order). With interleaved stages each chunk is a wrapper of its own, reducing in that chunk's
backwards.
zb: I runs inside the chunk's `input_pass()` (ZeRO-3 gathers the weights the input gradient needs,
then frees them), and a split W inside its `weight_pass()` when it has one, which makes W's
autograd calls (one per weight operation) one synchronising backward: ZeRO-2 stages the gradients
and reduce-scatters at W's end, ZeRO-3 gathers each unit ahead of its calls and reduces it once its
gradients are in. Every micro-batch is reduced once, in its W.
The copies of a tied embedding/head under sharded chunks are summed from the shards after the
schedule (`tied_shards.TiedShards`: whole copy gathered over dp×cp, swapped, each rank adding the
other copy's elements of its ranges). A stage names its copy of a tied weight in its `tied`
attribute (partition.py's `split_model`); the runner finds it among the modules of each chunk.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence

import torch
from torch import nn

from ndtrain.dist.comm import Pending
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.pipeline.hooks import StageHooks
from ndtrain.parallel.pipeline.schedules import Action, build, forward_actions, place, stage_of, with_communication
from ndtrain.parallel.pipeline.split_backward import WeightPasses
from ndtrain.parallel.pipeline.tied_shards import tied_shards
from ndtrain.parallel.pipeline.timeline import Timeline

MicroBatch = tuple[torch.Tensor, ...]  # (tokens, targets) or (tokens, targets, positions) of a cp shard
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_HEADER = 10


class _Step:
    """The state of one `run_pipeline` call on one rank."""

    def __init__(self, stages: list[nn.Module], micro_batches: list[MicroBatch],
                 ctx: ParallelContext, plans: list[list[Action]], timeline: Timeline | None,
                 forward_only: bool = False, loss_scale: float = 1.0, hooks: list[StageHooks] | None = None,
                 weights: torch.Tensor | None = None) -> None:
        self.stages, self.micro_batches, self.ctx, self.timeline = stages, micro_batches, ctx, timeline
        self.hooks = hooks if hooks is not None else [StageHooks() for _ in stages]
        self.loss_scale, self.weights = loss_scale, weights
        self.group = ctx.group("pp")
        self.p, self.rank, self.v, self.m = self.group.size, self.group.rank, len(stages), len(micro_batches)
        self.last = self.p * self.v - 1
        self.forward_only = forward_only
        self.plan = plans[self.rank]
        peers = {(self.rank + 1) % self.p, (self.rank - 1) % self.p} - {self.rank}  # wrap-around: interleaved
        self.expected = {q: deque(self._messages_to_me(plans[q], q)) for q in peers}
        self.final = {}  # chunk -> index of its last gradient-accumulating action
        for k, a in enumerate(self.plan):
            if a.kind in ("B", "W"):
                self.final[a.chunk] = k
        self.received: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]] = {}
        self.in_meta: dict[int, tuple[torch.dtype, torch.Size]] = {}  # chunk -> its input activation
        self.out_meta: dict[int, tuple[torch.dtype, torch.Size]] = {}  # chunk -> its output activation
        self.header_sent: set[int] = set()
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int], torch.Tensor | None] = {}
        self.weight_passes: dict[tuple[int, int], WeightPasses] = {}
        self.to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        self.sends: list[tuple[Pending, list[torch.Tensor]]] = []
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.live = 0

    # ------------------------------------------------------------------ message order
    def _messages_to_me(self, plan: list[Action], q: int) -> list[tuple[str, int, int]]:
        """(kind, mb, my chunk) of the messages peer q sends me, in its sending order; a header
        ("H", −1, chunk) precedes the first activation into each of my chunks."""
        out, headed = [], set()
        for a in plan:
            s = stage_of(q, a.chunk, self.p)
            target = s + 1 if a.kind == "SEND_F" else s - 1 if a.kind == "SEND_B" else None
            if target is None or place(target, self.p)[0] != self.rank:
                continue
            chunk = place(target, self.p)[1]
            if a.kind == "SEND_F" and chunk not in headed:
                headed.add(chunk)
                out.append(("H", -1, chunk))
            out.append((a.kind[-1], a.mb, chunk))
        return out

    def _post_until(self, peer: int, key: tuple[str, int, int]) -> None:
        while key not in self.received:
            kind, mb, chunk = item = self.expected[peer].popleft()
            if kind == "H":
                header = torch.empty(_HEADER, dtype=torch.int64, device=self.ctx.device)
                self.ctx.comm.batch_send_recv([], [(header, peer)], self.group).wait()
                dtype, ndim = _DTYPES[int(header[0])], int(header[1])
                self.in_meta[chunk] = (dtype, torch.Size(header[2 : 2 + ndim].tolist()))
                continue
            dtype, shape = self.in_meta[chunk] if kind == "F" else self.out_meta[chunk]
            buffer = torch.empty(shape, dtype=dtype, device=self.ctx.device)
            self.received[item] = (buffer, self.ctx.comm.batch_send_recv([], [(buffer, peer)], self.group))

    def _receive(self, kind: str, mb: int, chunk: int) -> torch.Tensor:
        key = (kind, mb, chunk)
        s = stage_of(self.rank, chunk, self.p)
        peer = place(s - 1 if kind == "F" else s + 1, self.p)[0]
        if peer != self.rank:
            self._post_until(peer, key)
        buffer, pending = self.received.pop(key)
        if pending is not None:
            pending.wait()
        if peer != self.rank:
            self._post_next(peer)
        return buffer

    def _post_next(self, peer: int) -> None:
        """Post the peer's next message now, so its transfer overlaps this rank's compute (one
        buffer ahead per peer), when its shape is already known."""
        queue = self.expected[peer]
        if queue and queue[0][0] != "H":
            kind, _, chunk = queue[0]
            if chunk in (self.in_meta if kind == "F" else self.out_meta):
                self._post_until(peer, queue[0])

    def _send(self, kind: str, mb: int, chunk: int) -> None:
        tensor = self.to_send.pop((kind, mb, chunk))
        s = stage_of(self.rank, chunk, self.p)
        peer = place(s + 1 if kind == "F" else s - 1, self.p)[0]
        tensors = [tensor]
        if kind == "F" and chunk not in self.header_sent:
            self.header_sent.add(chunk)
            meta = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            header = torch.tensor(meta + [0] * (_HEADER - len(meta)), dtype=torch.int64, device=tensor.device)
            tensors.insert(0, header)
        pending = self.ctx.comm.batch_send_recv([(t, peer) for t in tensors], [], self.group)
        self.sends.append((pending, tensors))

    def _hand_over(self, kind: str, mb: int, chunk: int, tensor: torch.Tensor) -> None:
        """Give a stage's output (F) or input gradient (B) to its neighbour stage, local or remote."""
        s = stage_of(self.rank, chunk, self.p)
        rank, other_chunk = place(s + 1 if kind == "F" else s - 1, self.p)
        if rank == self.rank:
            self.received[(kind, mb, other_chunk)] = (tensor, None)
        else:
            self.to_send[(kind, mb, chunk)] = tensor.contiguous()

    # ------------------------------------------------------------------ compute
    def forward(self, mb: int, chunk: int) -> None:
        s = stage_of(self.rank, chunk, self.p)
        tokens, targets, *positions = self.micro_batches[mb]  # positions: a context-parallel shard's
        x = tokens if s == 0 else self._receive("F", mb, chunk).requires_grad_()
        out = self.stages[chunk](x, targets, *positions)
        if s == self.last:
            out = out * (self.weights[mb].to(out.dtype) if self.weights is not None else 1.0 / self.m)
            self.loss_sum += out.detach().double()
            out = out * self.loss_scale
        else:
            self.out_meta[chunk] = (out.dtype, out.shape)
            self._hand_over("F", mb, chunk, out.detach())
        if self.forward_only:
            return
        self.inputs[(mb, chunk)], self.outputs[(mb, chunk)] = x, out
        self.live += 1
        if self.timeline is not None:
            self.timeline.peak_live = max(self.timeline.peak_live, self.live)

    def backward(self, mb: int, chunk: int, index: int, part: str) -> None:
        """part B: input and weight gradients; I: input only (keeps the graph); W: weights only."""
        s = stage_of(self.rank, chunk, self.p)
        key = (mb, chunk)
        if part == "W":
            grad = self.grad_out.pop(key)
        else:
            grad = None if s == self.last else self._receive("B", mb, chunk)
        x, out = self.inputs[key], self.outputs[key]
        stage, hooks = self.stages[chunk], self.hooks[chunk]
        params = [p for p in stage.parameters() if p.requires_grad]
        if part == "I":
            self.grad_out[key] = grad
            if s > 0:
                passes = WeightPasses(out, params)
                with hooks.input_pass():
                    (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
                passes.input_pass_done()
                self.weight_passes[key] = passes
                self._hand_over("B", mb, chunk, gx)
            return
        no_sync = hooks.no_sync  # set: gradients accumulate locally, synchronised in the chunk's final backward
        final = self.final[chunk] == index
        with no_sync() if no_sync is not None and not final else contextlib.nullcontext():
            passes = self.weight_passes.pop(key, None)
            split = part == "W" and passes is not None and passes.complete
            if split and hooks.weight_pass is not None:  # W's calls are one synchronising backward
                with hooks.weight_pass() as before:
                    passes.run(before)
            elif split and not (no_sync is not None and final):
                passes.run()  # a deferred sync needs the final W as one backward: re-walk instead
            elif part == "W":
                torch.autograd.backward(out, grad, inputs=params)
            else:
                torch.autograd.backward(out, grad)
        if part == "B" and s > 0:
            self._hand_over("B", mb, chunk, x.grad)
        del self.inputs[key], self.outputs[key]
        self.live -= 1

    def run(self) -> None:
        for index, a in enumerate(self.plan):
            start = self.timeline.now() if self.timeline is not None else 0.0
            if a.kind == "F":
                self.forward(a.mb, a.chunk)
            elif a.kind in ("B", "I", "W"):
                self.backward(a.mb, a.chunk, index, a.kind)
            elif a.kind.startswith("SEND"):
                self._send(a.kind[-1], a.mb, a.chunk)
                continue
            else:  # RECV: post (and wait) now so the timeline shows the wait; the compute pops it
                key = (a.kind[-1], a.mb, a.chunk)
                buffer = self._receive(*key)
                self.received[key] = (buffer, None)
            if self.timeline is not None:
                self.timeline.record(a.kind, a.mb, a.chunk, start)
        for pending, _ in self.sends:
            pending.wait()
        self.sends.clear()


def _tied_weight(stages: list[nn.Module]) -> nn.Parameter | None:
    """This rank's copy of a tied embedding/head weight: named by the `tied` attribute of a pipeline
    stage (`split_model`'s) among the chunks' modules, wrapped or not."""
    for stage in stages:
        for module in stage.modules():
            name = getattr(module, "tied", None)
            if name:
                return module.get_parameter(name)
    return None


def run_pipeline(
    stages: list[nn.Module], micro_batches: list[MicroBatch], ctx: ParallelContext,
    schedule: str, timeline: Timeline | None = None, loss_scale: float = 1.0,
    hooks: Sequence[StageHooks] | None = None, weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward and backward of all micro-batches `(inputs, targets[, positions])` (the same list on
    every pp rank; under context parallel this cp rank's sequence shards and their global positions)
    through this rank's `stages` (from `split_model`, optionally each in a data-parallel wrapper whose
    synchronisation `hooks` gives, one per stage; None: bare stages).

    Returns Σ_i w_i · loss_i (float64, on every pp rank), w_i = `weights[i]` (the engine's, from
    parallel/target_mean.py; None: 1/m each, the mean over micro-batches). Its gradients, times
    `loss_scale` (fp16: applied on the last stage, so every stage's gradients carry it), are
    accumulated into `.grad`."""
    p = ctx.group("pp").size
    plans = build(schedule, p, len(micro_batches), len(stages))  # validates (p, m, v) first
    if hooks is not None and len(hooks) != len(stages):
        raise ValueError(f"{len(hooks)} stage hooks for {len(stages)} stage chunks: give one per chunk")
    step = _Step(stages, micro_batches, ctx, plans, timeline, loss_scale=loss_scale,
                 hooks=None if hooks is None else list(hooks), weights=weights)
    tied = _tied_weight(stages) if step.p > 1 else None
    sharded = [s for s, h in zip(stages, step.hooks) if h.gradients_sharded]
    tied_grads = tied_shards(sharded, tied) if tied is not None and sharded else None
    stash = None
    if tied_grads is not None:
        stash = [g.clone() for g in tied_grads.pieces]
        for g in tied_grads.pieces:
            g.zero_()
    elif tied is not None and tied.grad is not None:
        stash = [tied.grad.clone()]
        tied.grad.zero_()
    if timeline is not None:
        timeline.start(ctx)
    step.run()
    if tied is not None:
        peer = step.p - 1 if step.rank == 0 else 0
        if tied_grads is not None:
            tied_grads.sum_with(peer, ctx, step.group)
        else:
            other = torch.empty_like(tied.grad)
            ctx.comm.batch_send_recv([(tied.grad, peer)], [(other, peer)], step.group).wait()
            tied.grad.add_(other)
        pieces = tied_grads.pieces if tied_grads is not None else [tied.grad]
        for piece, kept in zip(pieces, stash or []):  # what the gradients held before this step
            piece.add_(kept)
    loss = step.loss_sum
    ctx.comm.broadcast(loss, step.group, src=place(step.last, step.p)[0])
    return loss


@torch.no_grad()
def eval_pipeline(stages: list[nn.Module], micro_batches: list[MicroBatch], ctx: ParallelContext) -> torch.Tensor:
    """Forward only (GPipe's forward order, nothing kept for backward): the mean over micro-batches of
    their mean losses (float64), on every pp rank."""
    p, m, v = ctx.group("pp").size, len(micro_batches), len(stages)
    step = _Step(stages, micro_batches, ctx, with_communication(forward_actions(p, m, v), p, v), None, forward_only=True)
    step.run()
    loss = step.loss_sum
    ctx.comm.broadcast(loss, step.group, src=place(step.last, step.p)[0])
    return loss
