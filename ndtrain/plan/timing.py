"""Time per training step: compute, tensor/context/pipeline/data-parallel communication, bubble.

Per micro-batch on the slowest stage (L_s layers, the logits on the last), t tp, c cp, b mbs,
s' = s/c local tokens per sequence, β bytes per activation value:

compute   FLOPs / (peak·η)  +  element-wise traffic / HBM bandwidth
          FLOPs per layer: forward b·s'·(2W + 4·s·a·d)/t (`arch.py`), backward 2× forward;
          recompute adds a forward of the layer (full) or of QKᵀ and AV (selective; always
          for flash attention, whose backward recomputes the scores: Dao 2022).
          Element-wise traffic: the layer's activations (`memory.py`, no recompute) written and
          read once in the forward (2 passes) and twice that in the backward, like the FLOPs.
tp        2 all-reduces per layer forward and 2 backward of b·s'·h·β bytes (Shoeybi 2019 §3);
          with SP each becomes an all-gather + reduce-scatter of the same total cost
          (Korthikanti 2022 §4.2.2); full recompute replays the forward's 2. Never overlapped.
          Vocabulary parallelism adds, per micro-batch on the stage holding them: the embedding's
          all-reduce of b·s'·h·β (forward), the head input's (backward) and the cross-entropy's
          two all-reduces of b·s' and 2·b·s' fp32 numbers (forward). With SP on a CPU profile
          (which plans ndtrain's own processes) each norm weight's gradient (2 per layer + the
          final norm) is all-reduced over tp in every backward (`sum_gradient_over`: h·4 bytes,
          latency-bound); Megatron reduces them once per step, negligible at scale, so GPUs skip it.
cp        ring attention (Liu 2023; Megatron context parallel): c−1 steps per layer, each sending
          the K and V chunk b·s'·2·k_t·d·β (k_t kv heads per tp rank), overlapped with that
          step's attention block; the backward sends K, V and their gradients (2×).
pp        one send/recv of b·s'·h·β/t per chunk boundary, forward and backward (the
          scatter/gather optimisation of Narayanan 2021 §4.1), v per micro-batch when interleaved;
          synchronous, so on the critical path.
step      m·(t_f + t_b) + bubble (`schedules.py`) + exposed dp/ZeRO communication + optimizer
dp/ZeRO   over N = dp·c ranks, Ψ the stage's parameters per rank, the slowest link the group spans:
          stage 0   all-reduce 2Ψ behind the last micro-batch's backward (DDP buckets), except
                    the last bucket (Li 2020, PyTorch DDP)
          stage 1   reduce-scatter 2Ψ (as above) + all-gather 2Ψ of updated weights behind the
                    next forward, except the first bucket (Megatron distributed optimizer)
          stage 2   as stage 1, but the reduce-scatter runs every micro-batch (no full gradient
                    buffer to accumulate into)
          stage 3   every micro-batch: all-gather 2Ψ behind the forward, all-gather 2Ψ +
                    reduce-scatter 2Ψ behind the backward, except one layer's gather (FSDP)
optimizer Adam reads and writes 28 bytes per (sharded) parameter, at HBM bandwidth.
Overlap ("behind") holds on GPUs only: on a CPU profile every collective is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.plan import collectives, schedules
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster, Link
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import activation_coefficients, layer_activation_bytes, stage_params

BUCKET_BYTES = 25 * 1024**2  # DDP's default bucket cap
OPTIMIZER_TRAFFIC_BYTES = 28  # fp32 master, m, v read + written (24), gradient read, weight written


@dataclass(frozen=True)
class Timing:
    compute: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    model_flops: float  # per step, all ranks, no recompute
    hardware_flops: float  # per step, all ranks, with recompute

    @property
    def step(self) -> float:
        return self.compute + self.tp_comm + self.cp_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on the slowest stage, forward (f) and backward (b) parts."""

    compute_f: float
    compute_b: float
    tp_f: float
    tp_b: float
    cp_f: float
    cp_b: float
    pp_f: float
    pp_b: float

    @property
    def t_f(self) -> float:
        return self.compute_f + self.tp_f + self.cp_f + self.pp_f

    @property
    def t_b(self) -> float:
        return self.compute_b + self.tp_b + self.cp_b + self.pp_b


def _micro_batch(model: ModelSpec, layout: Layout, cluster: Cluster) -> _MicroBatch:
    hw = cluster.hardware
    beta = hw.precision.activation_bytes
    rate = hw.peak_flops * hw.matmul_efficiency
    tokens = layout.mbs * model.seq / layout.cp
    layers = model.layers if layout.pp == 1 else layout.stage_layers(model.layers)

    layer_f = tokens * model.layer_forward_flops_per_token / layout.tp / rate
    attention_f = tokens * model.attention_forward_flops_per_token / layout.tp / rate
    logits_f = tokens * model.logits_forward_flops_per_token / layout.tp / rate  # the last stage is the slowest
    memory_f = 2 * layer_activation_bytes(model, layout, hw.precision, "none") / hw.hbm_bandwidth
    scores_f = 2 * _score_bytes(model, layout, beta) / hw.hbm_bandwidth
    recompute = {"none": 0.0, "selective": attention_f + scores_f, "full": layer_f + memory_f}[layout.recompute]
    if model.flash_attention and layout.recompute == "none":
        recompute = attention_f
    compute_f = layers * (layer_f + memory_f) + logits_f
    compute_b = 2 * compute_f + layers * recompute

    tp_link = cluster.link(1, layout.tp)
    tp_one = collectives.all_reduce(layout.tp, tokens * model.hidden * beta, tp_link)
    tp_f = layers * 2 * tp_one + _vocab_forward(layout, tokens, tp_one, tp_link)
    tp_b = layers * (2 + (2 if layout.recompute == "full" else 0)) * tp_one + tp_one  # + the head's input
    if layout.sp and hw.kind == "cpu":  # ndtrain's norm gradients, per micro-batch: 2 per layer and the final norm
        tp_b += (2 * layers + 1) * collectives.all_reduce(layout.tp, model.hidden * 4, tp_link)

    cp_f = cp_b = 0.0
    if layout.cp > 1:
        kv_heads = max(1, model.kv_heads // layout.tp)
        chunk = tokens * 2 * kv_heads * model.head_dim * beta
        ring = (layout.cp - 1) * collectives.send_recv(chunk, cluster.link(layout.tp * layout.pp, layout.cp))
        hidden = attention_f if hw.overlaps_comm else 0.0
        cp_f = layers * max(0.0, ring - hidden)
        cp_b = layers * max(0.0, 2 * ring - 2 * hidden)

    pp_f = pp_b = 0.0
    if layout.pp > 1:
        boundary = tokens * model.hidden * beta / layout.tp
        pp_f = pp_b = layout.vpp * collectives.send_recv(boundary, cluster.link(layout.tp, layout.pp))
    return _MicroBatch(compute_f, compute_b, tp_f, tp_b, cp_f, cp_b, pp_f, pp_b)


def _vocab_forward(layout: Layout, tokens: float, tp_one: float, link: Link) -> float:
    """Forward tp communication of the vocabulary-parallel ends on the slowest (last) stage: the
    cross-entropy's max and sum all-reduces (fp32), and the embedding's all-reduce when pp = 1."""
    loss = collectives.all_reduce(layout.tp, tokens * 4, link) + collectives.all_reduce(layout.tp, 2 * tokens * 4, link)
    return loss + (tp_one if layout.pp == 1 else 0.0)


def _score_bytes(model: ModelSpec, layout: Layout, beta: int) -> float:
    """The score-matrix part of one layer's activations (what selective recompute rebuilds)."""
    z = activation_coefficients(model, beta)[2]
    return model.heads * (model.seq / layout.cp) * model.seq * layout.mbs * z / layout.tp


def _data_parallel(model: ModelSpec, layout: Layout, cluster: Cluster, mb: _MicroBatch, m: int) -> float:
    n = layout.dp * layout.cp
    if n == 1:
        return 0.0
    precision = cluster.hardware.precision
    link = cluster.link(layout.tp * layout.pp, n)
    psi = stage_params(model, layout, "last" if layout.pp > 1 else "only")
    grads, weights = psi * precision.grad_bytes, psi * precision.param_bytes
    bucket = min(BUCKET_BYTES, grads)
    overlap = 1.0 if cluster.hardware.overlaps_comm else 0.0
    window_f, window_b = overlap * mb.compute_f, overlap * mb.compute_b
    if layout.zero == 0:
        return collectives.exposed(collectives.all_reduce(n, grads, link), window_b,
                                   collectives.all_reduce(n, bucket, link))
    first_layer = model.layer_params / layout.tp * precision.param_bytes
    gather = collectives.exposed(collectives.all_gather(n, weights, link), window_f,
                                 collectives.all_gather(n, min(bucket, first_layer), link))
    scatter = collectives.exposed(collectives.reduce_scatter(n, grads, link), window_b,
                                  collectives.reduce_scatter(n, bucket, link))
    if layout.zero == 1:
        return scatter + gather
    if layout.zero == 2:
        return m * scatter + gather
    backward = collectives.all_gather(n, weights, link) + collectives.reduce_scatter(n, grads, link)
    return m * (gather + collectives.exposed(backward, window_b, collectives.all_gather(n, first_layer, link)))


def _optimizer(model: ModelSpec, layout: Layout, cluster: Cluster) -> float:
    psi = stage_params(model, layout, "last" if layout.pp > 1 else "only")
    if layout.zero >= 1:
        psi /= layout.dp * layout.cp
    return psi * OPTIMIZER_TRAFFIC_BYTES / cluster.hardware.hbm_bandwidth


def flops_per_step(model: ModelSpec, layout: Layout, global_batch: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step over all ranks."""
    tokens = global_batch * model.seq
    model_flops = tokens * model.model_flops_per_token
    recompute = "selective" if (model.flash_attention and layout.recompute == "none") else layout.recompute
    extra = {"none": 0, "selective": model.attention_forward_flops_per_token,
             "full": model.layer_forward_flops_per_token}[recompute]
    return model_flops, model_flops + tokens * model.layers * extra


def step_time(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int) -> Timing:
    m = layout.micro_batches(global_batch)
    mb = _micro_batch(model, layout, cluster)
    bubble = schedules.bubble_time(layout.schedule, layout.pp, layout.vpp, mb.t_f, mb.t_b)
    model_flops, hardware_flops = flops_per_step(model, layout, global_batch)
    return Timing(
        compute=m * (mb.compute_f + mb.compute_b),
        tp_comm=m * (mb.tp_f + mb.tp_b),
        cp_comm=m * (mb.cp_f + mb.cp_b),
        pp_comm=m * (mb.pp_f + mb.pp_b),
        bubble=bubble,
        dp_comm=_data_parallel(model, layout, cluster, mb, m),
        optimizer=_optimizer(model, layout, cluster),
        model_flops=model_flops,
        hardware_flops=hardware_flops,
    )
