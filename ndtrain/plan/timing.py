"""Time per training step: compute, tensor/context/pipeline/data-parallel communication, bubble.

Per micro-batch on the slowest stage (L_s layers, the logits on the last), t tp, c cp, b mbs,
s' = s/c local tokens per sequence, β bytes per activation value:

compute   on GPUs `gpu_compute.py`: per layer, GEMM arithmetic at η_mm·peak plus operand traffic,
          the attention kernel, element-wise passes over the activations at HBM bandwidth;
          backward 2× forward; recompute adds a layer forward (full) or the attention (selective;
          always for flash attention, whose backward recomputes the scores: Dao 2022).
tp        2 all-reduces per layer forward and 2 backward of b·s'·h·β bytes (Shoeybi 2019 §3);
          with SP each becomes an all-gather + reduce-scatter of the same total cost
          (Korthikanti 2022 §4.2.2); full recompute replays the forward's 2. Not overlapped, unless
          the hardware says so (`Hardware.tp_overlap`, a published run's Megatron --tp-comm-overlap):
          then only what outlasts the micro-batch's compute is exposed. Transformer Engine's overlap
          splits each GEMM and moves the chunks by copy engines or a few SMs, so no φ is charged
          (with φ, the Megatron-LM rows' leave-one-source-out worst error was 34 %, 13 % without).
          Vocabulary parallelism adds, per micro-batch on the stage holding them: the embedding's
          all-reduce of b·s'·h·β (forward), the head input's (backward) and the cross-entropy's
          two all-reduces of b·s' and 2·b·s' fp32 numbers (forward). With SP on a CPU profile
          (which plans ndtrain's own processes) each norm weight's gradient (2 per layer + the
          final norm) is all-reduced over tp in every backward (`sum_gradient_over`: h·4 bytes,
          latency-bound); Megatron reduces them once per step, negligible at scale, so GPUs skip it.
cp        ring attention (Liu 2023; Megatron context parallel): c−1 steps per layer, each sending
          the K and V chunk b·s'·2·k_t·d·β (k_t kv heads per tp rank), overlapped with that
          step's attention block; the backward sends K, V and their gradients (2×).
pp        one send/recv per chunk boundary, forward and backward, v per micro-batch when
          interleaved; synchronous, so on the critical path. Each tp rank sends the activation it
          holds: b·s'·h·β, or 1/t of it with SP, whose activations are split by sequence (ndtrain's
          runner). With scatter/gather (Narayanan 2021 §4.1; `Hardware.pp_scatter_gather`: the
          published Megatron-LM and DeepSpeed runs') each sends 1/t and the receiver all-gathers
          the whole over tp.
step      m·(t_f + t_b) + bubble (`schedules.py`) + exposed dp/ZeRO communication + optimizer
dp/ZeRO   over N = dp·c ranks, Ψ the stage's parameters per rank, the link of the group (`Cluster.link`);
          communication hidden behind compute still costs φ of its time (efficiency.overlap_cost);
          where the stack reduces after the last backward (`Hardware.dp_overlap` False: Megatron-LM's
          local DDP of 2021-22, DeepSpeed's pipeline engine) nothing hides it:
          stage 0   all-reduce 2Ψ behind the last micro-batch's backward (DDP buckets), except
                    the last bucket (Li 2020, PyTorch DDP)
          stage 1   reduce-scatter 2Ψ (as above) + all-gather 2Ψ of updated weights behind the
                    next forward, except the first bucket (Megatron distributed optimizer)
          stage 2   as stage 1, but the reduce-scatter runs every micro-batch (no full gradient
                    buffer to accumulate into)
          stage 3   every micro-batch: all-gather 2Ψ behind the forward, all-gather 2Ψ +
                    reduce-scatter 2Ψ behind the backward, except one layer's gather (FSDP)
          Under pp the per-micro-batch part (stage 2's reduce-scatter, stage 3's gathers and
          reduce-scatter) lengthens every stage's slot, so the bubble counts it too.
optimizer Adam reads and writes 28 bytes per (sharded) parameter, at HBM bandwidth.
Overlap ("behind") holds on GPUs only: on a CPU profile every collective is exposed.
CPU profile (`cpu_profile.py`): compute is the model's measured block and ends per (tp, mbs)
          when the profile has them (÷ c for cp; recompute adds the attention's FLOP share of a
          block forward, or a block forward); each collective uses the fit for its op and group
          size; ZeRO-1 is ndtrain's all-reduce + all-gather; ZeRO-3's backward re-gathers the
          blocks only (the root unit, the stage's ends, stays gathered from its forward until its
          reduce-scatter: zero3_parameters.py); SP's all-gather + reduce-scatter are priced apart;
          the optimizer at the measured rate of the engine's step after the backward (the gradient's
          norm and clip, AdamW, zeroing: calibrate_layers.py); zb's backward at the measured
          input pass + weight passes (t_W measured too). With P processes on S < P slots:
          without pp, shared = max(0, sharing · (all processes' compute) / S − critical path);
          with pp, the schedule run on the shared slots (`cpu_pipeline.py`) − the other terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from ndtrain.parallel.pipeline import schedules as pipeline_schedules
from ndtrain.plan import collectives, cpu_pipeline, gpu_compute, schedules
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.cpu_profile import model_key
from ndtrain.plan.hardware import Cluster
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import stage_params

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
    shared_cores: float  # CPU profiles with more processes than compute slots: see _shared_cores
    model_flops: float  # per step, all ranks, no recompute
    hardware_flops: float  # per step, all ranks, with recompute

    @property
    def step(self) -> float:
        return (self.compute + self.tp_comm + self.cp_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer
                + self.shared_cores)


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on the slowest stage, forward (f) and backward (b) parts."""

    compute_f: float
    compute_b: float  # for zb on a CPU profile: the measured input pass + weight passes
    compute_w: float  # zb's weight passes, part of compute_b (half of it when not measured)
    tp_f: float
    tp_b: float
    cp_f: float
    cp_b: float
    pp_f: float
    pp_b: float
    pieces: _Compute  # what the stage costs are made of (for the shared-cores term)

    @property
    def t_f(self) -> float:
        return self.compute_f + self.tp_f + self.cp_f + self.pp_f

    @property
    def t_b(self) -> float:
        return self.compute_b + self.tp_b + self.cp_b + self.pp_b


def _micro_batch(model: ModelSpec, layout: Layout, cluster: Cluster) -> _MicroBatch:
    hw = cluster.hardware
    beta = hw.precision.activation_bytes
    tokens = layout.mbs * model.seq / layout.cp
    layers = model.layers if layout.pp == 1 else layout.stage_layers(model.layers)
    compute = _compute(model, layout, cluster)
    forward, backward = compute.forward(layers), compute.backward(layers)  # the last stage

    tp_one = _collective(cluster, "all_reduce", 1, layout.tp, tokens * model.hidden * beta)
    if layout.sp and hw.cpu is not None:  # each all-reduce becomes an all-gather + a reduce-scatter of
        # the same bytes: the ring volume is equal (so on GPUs the cost), gloo's measured cost is not
        tp_one = sum(_collective(cluster, op, 1, layout.tp, tokens * model.hidden * beta)
                     for op in ("all_gather", "reduce_scatter"))
    tp_f = layers * 2 * tp_one + _vocab_forward(cluster, layout, tokens, tp_one)
    tp_b = layers * (2 + (2 if layout.recompute == "full" else 0)) * tp_one + tp_one  # + the head's input
    if hw.tp_overlap and hw.overlaps_comm:  # behind the GEMMs; only what outlasts them is exposed
        tp_f, tp_b = (collectives.exposed(tp, window, 0.0)
                      for tp, window in ((tp_f, forward), (tp_b, backward)))
    if layout.sp and hw.kind == "cpu":  # ndtrain's norm gradients, per micro-batch: 2 per layer and the final norm
        tp_b += (2 * layers + 1) * _collective(cluster, "all_reduce", 1, layout.tp, model.hidden * 4)

    cp_f = cp_b = 0.0
    if layout.cp > 1:
        kv_heads = max(1, model.kv_heads // layout.tp)
        chunk = tokens * 2 * kv_heads * model.head_dim * beta
        ring = (layout.cp - 1) * _collective(cluster, "send_recv", layout.tp * layout.pp, layout.cp, chunk)
        hidden = compute.attention_f if hw.overlaps_comm else 0.0
        cp_f = layers * max(0.0, ring - hidden)
        cp_b = layers * max(0.0, 2 * ring - 2 * hidden)

    pp_f = pp_b = 0.0
    if layout.pp > 1:
        boundary = tokens * model.hidden * beta
        split = layout.sp or hw.pp_scatter_gather
        gather = (_collective(cluster, "all_gather", 1, layout.tp, boundary)
                  if hw.pp_scatter_gather and not layout.sp else 0.0)
        send = _collective(cluster, "send_recv", layout.tp, layout.pp, boundary / (layout.tp if split else 1))
        pp_f = pp_b = layout.vpp * (send + gather)
    if layout.pp > 1 and layout.schedule == "zb":
        inputs, weights = compute.split(layers)
        backward = inputs + weights
    else:
        weights = backward / 2
    return _MicroBatch(forward, backward, weights, tp_f, tp_b, cp_f, cp_b, pp_f, pp_b, compute)


class _Compute(NamedTuple):
    """One micro-batch's compute seconds on one rank: per layer, and for the model's ends (embedding,
    final norm, logits, loss: all counted on the last stage)."""

    layer_f: float
    layer_b: float  # with recompute
    layer_i: float  # zb's input pass, with recompute (half the backward unless a CPU profile measured it)
    layer_w: float  # zb's weight passes
    ends_f: float
    ends_b: float
    ends_i: float  # the ends' backward split in the block's proportions
    ends_w: float
    attention_f: float  # one layer's attention core forward (what cp's ring can hide behind)

    def forward(self, layers: int, last: bool = True) -> float:
        return layers * self.layer_f + (self.ends_f if last else 0.0)

    def backward(self, layers: int, last: bool = True) -> float:
        return layers * self.layer_b + (self.ends_b if last else 0.0)

    def split(self, layers: int, last: bool = True) -> tuple[float, float]:
        """zb's (input pass, weight passes) of a stage."""
        return (layers * self.layer_i + (self.ends_i if last else 0.0),
                layers * self.layer_w + (self.ends_w if last else 0.0))


def _compute(model: ModelSpec, layout: Layout, cluster: Cluster) -> _Compute:
    """Seconds of one micro-batch's compute: measured pieces of a CPU profile when it has them, the
    terms of `gpu_compute` otherwise."""
    hw = cluster.hardware
    attention_share = model.attention_forward_flops_per_token / model.layer_forward_flops_per_token
    pieces = hw.cpu.piece_times(model, layout.tp, layout.mbs) if hw.cpu is not None else None
    if pieces is not None:  # measured at the full sequence: a cp rank runs 1/cp of the tokens
        layer_f, ends_f, ends_b = pieces.layer_f / layout.cp, pieces.head_f / layout.cp, pieces.head_b / layout.cp
        layer_b, attention_f = pieces.layer_b / layout.cp, attention_share * pieces.layer_f / layout.cp
        layer_i, layer_w = pieces.layer_i / layout.cp, pieces.layer_w / layout.cp
        recompute = {"none": 0.0, "selective": attention_f, "full": layer_f}[layout.recompute]
    else:
        gpu = gpu_compute.compute(model, layout, hw)
        layer_f, layer_b, recompute = gpu.layer.total, gpu.layer_b, gpu.recompute
        ends_f, ends_b, attention_f = gpu.ends_f, gpu.ends_b, gpu.attention_f
        layer_i = layer_w = layer_b / 2
    ends_i, ends_w = ((ends_b * layer_i / layer_b, ends_b * layer_w / layer_b) if layer_b > 0
                      else (ends_b / 2, ends_b / 2))
    return _Compute(layer_f, layer_b + recompute, layer_i + recompute, layer_w, ends_f, ends_b, ends_i, ends_w,
                    attention_f)


def _collective(cluster: Cluster, op: str, stride: int, n: int, nbytes: float) -> float:
    """Seconds of `op` over n ranks spaced `stride` apart: the profile's fit for that op and group size
    on a CPU, the slowest link the group spans on a GPU cluster (for a send/recv, one pair's link)."""
    cpu = cluster.hardware.cpu
    if cpu is not None:
        link = cpu.link(op, n)
    else:
        link = cluster.pair_link(stride, n) if op == "send_recv" else cluster.link(stride, n)
    if op == "send_recv":
        return collectives.send_recv(nbytes, link)
    return getattr(collectives, op)(n, nbytes, link)


def _vocab_forward(cluster: Cluster, layout: Layout, tokens: float, tp_one: float) -> float:
    """Forward tp communication of the vocabulary-parallel ends on the slowest (last) stage: the
    cross-entropy's max and sum all-reduces (fp32), and the embedding's all-reduce when pp = 1."""
    loss = sum(_collective(cluster, "all_reduce", 1, layout.tp, nbytes) for nbytes in (tokens * 4, 2 * tokens * 4))
    return loss + (tp_one if layout.pp == 1 else 0.0)


class _DataParallel(NamedTuple):
    """Exposed dp/ZeRO seconds: per micro-batch, in its forward and its backward (ZeRO-2's
    reduce-scatter, ZeRO-3's gathers and reduce-scatter), and once per step."""

    micro_batch_f: float
    micro_batch_b: float
    per_step: float

    def total(self, m: int) -> float:
        return m * (self.micro_batch_f + self.micro_batch_b) + self.per_step


def _data_parallel(model: ModelSpec, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> _DataParallel:
    n = layout.dp * layout.cp
    if n == 1:
        return _DataParallel(0.0, 0.0, 0.0)
    precision = cluster.hardware.precision

    def cost(op: str, nbytes: float) -> float:
        return _collective(cluster, op, layout.tp * layout.pp, n, nbytes)

    psi = stage_params(model, layout, "last" if layout.pp > 1 else "only")
    grads, weights = psi * precision.grad_bytes, psi * precision.param_bytes
    bucket = min(BUCKET_BYTES, grads)
    overlap = 1.0 if cluster.hardware.overlaps_comm and cluster.hardware.dp_overlap else 0.0
    window_f, window_b = overlap * mb.compute_f, overlap * mb.compute_b
    phi = cluster.hardware.efficiency.overlap_cost

    def behind(total: float, window: float, first_piece: float) -> float:
        """Exposed seconds, plus what the hidden part costs the compute it runs beside (φ)."""
        exposed = collectives.exposed(total, window, first_piece)
        return exposed + phi * (total - exposed)

    reduce = behind(cost("all_reduce", grads), window_b, cost("all_reduce", bucket))
    if layout.zero == 0:
        return _DataParallel(0.0, 0.0, reduce)
    first_layer = model.params_of_layer(0) / layout.tp * precision.param_bytes
    gather = behind(cost("all_gather", weights), window_f, cost("all_gather", min(bucket, first_layer)))
    scatter = behind(cost("reduce_scatter", grads), window_b, cost("reduce_scatter", bucket))
    if layout.zero == 1:  # ndtrain's ZeRO-1 keeps DDP's all-reduce (zero1_optimizer.py); Megatron reduce-scatters
        return _DataParallel(0.0, 0.0, (reduce if cluster.hardware.cpu is not None else scatter) + gather)
    if layout.zero == 2:
        return _DataParallel(0.0, scatter, gather)
    regathered = weights
    if cluster.hardware.cpu is not None:  # ndtrain's root unit (the stage's ends) is not gathered again
        layers = model.layers if layout.pp == 1 else layout.stage_layers(model.layers)
        held = model.layers_params(model.layers - layers if layout.pp > 1 else 0, layers)
        regathered -= (psi - held / layout.tp) * precision.param_bytes
    backward = cost("all_gather", regathered) + cost("reduce_scatter", grads)
    return _DataParallel(gather, behind(backward, window_b, cost("all_gather", first_layer)), 0.0)


def _optimizer(model: ModelSpec, layout: Layout, cluster: Cluster) -> float:
    psi = stage_params(model, layout, "last" if layout.pp > 1 else "only")
    if layout.zero >= 1:
        psi /= layout.dp * layout.cp
    cpu = cluster.hardware.cpu
    measured = cpu.adamw_s_per_param.get(model_key(model)) if cpu is not None else None
    if measured is not None:
        return psi * measured
    return psi * OPTIMIZER_TRAFFIC_BYTES / cluster.hardware.hbm_bandwidth


def _shared_cores(model: ModelSpec, layout: Layout, cluster: Cluster, mb: _MicroBatch, dp: _DataParallel, m: int,
                  busy: float, comm: float, optimizer: float) -> float:
    """Time added because P processes share S < P compute slots (CPU profiles), beyond the step's other
    terms (`busy`: compute, bubble and optimizer; `comm`: exposed communication). Without a pipeline,
    the communication stays on top and every process always has work: the step cannot be shorter
    than all processes' compute divided over the slots, times what sharing costs (`sharing`); every tp
    rank runs its shard of every micro-batch: Σ = dp·cp·tp · m · (whole model on one tp shard), and each
    process its optimizer step. With one, `cpu_pipeline` runs the schedule on the shared slots (a
    pipeline leaves slots idle in its warm-up and cool-down), then every process's optimizer step."""
    cpu = cluster.hardware.cpu
    if cpu is None or layout.world <= cpu.slots:
        return 0.0
    sharing = cpu.sharing_for(model)
    if layout.pp == 1:
        whole_model = mb.pieces.forward(model.layers) + mb.pieces.backward(model.layers)
        work = layout.dp * layout.cp * layout.tp * m * whole_model + layout.world * optimizer
        return max(0.0, sharing * work / cpu.slots - busy)
    slots = cpu_pipeline.Slots(layout.dp * layout.cp * layout.tp, cpu.slots, sharing)
    actions = pipeline_schedules.compute_actions(layout.schedule, layout.pp, m, layout.vpp)
    pipeline = cpu_pipeline.makespan(actions, layout.pp, layout.vpp, _stage_work(model, layout, mb, dp), slots)
    return max(0.0, pipeline + dp.per_step + optimizer / slots.rate(layout.pp) - busy - comm)


def _stage_work(model: ModelSpec, layout: Layout, mb: _MicroBatch,
                dp: _DataParallel) -> Callable[[pipeline_schedules.Action, int], cpu_pipeline.Work]:
    """What each action of the schedule costs on stage s: the blocks split evenly over the p·v stages
    (earlier stages one more when they do not divide), the model's ends on the last; each action
    carries 1/v of the slowest stage's per-micro-batch communication. zb on the first stage: the input
    pass has no input to reach (the runner skips it) and the weight pass is a whole backward."""
    stages = layout.pp * layout.vpp
    comm_f = (mb.tp_f + mb.cp_f + mb.pp_f + dp.micro_batch_f) / layout.vpp
    comm_b = (mb.tp_b + mb.cp_b + mb.pp_b) / layout.vpp
    comm_w = dp.micro_batch_b / layout.vpp

    def work(action: pipeline_schedules.Action, stage: int) -> cpu_pipeline.Work:
        layers = model.layers // stages + (1 if stage < model.layers % stages else 0)
        last = stage == stages - 1
        if action.kind == "F":
            return cpu_pipeline.Work(mb.pieces.forward(layers, last), comm_f)
        if action.kind == "B" or (stage == 0 and action.kind == "W"):
            return cpu_pipeline.Work(mb.pieces.backward(layers, last), comm_b + comm_w)
        inputs, weights = mb.pieces.split(layers, last)
        if action.kind == "I":
            return cpu_pipeline.Work(0.0 if stage == 0 else inputs, comm_b)
        return cpu_pipeline.Work(weights, comm_w)

    return work


def flops_per_step(model: ModelSpec, layout: Layout, global_batch: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step over all ranks."""
    tokens = global_batch * model.seq
    model_flops = tokens * model.model_flops_per_token
    recompute = "selective" if (model.flash_attention and layout.recompute == "none") else layout.recompute
    extra = {"none": 0, "selective": model.attention_forward_flops_per_token,
             "op": model.attention_forward_flops_per_token + model.layer_matrix_weights,
             "full": model.layer_forward_flops_per_token}[recompute]
    return model_flops, model_flops + tokens * model.layers * extra


def step_time(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int) -> Timing:
    m = layout.micro_batches(global_batch)
    mb = _micro_batch(model, layout, cluster)
    dp = _data_parallel(model, layout, cluster, mb)
    bubble = schedules.bubble_time(layout.schedule, layout.pp, layout.vpp, mb.t_f + dp.micro_batch_f,
                                   mb.t_b + dp.micro_batch_b, m, mb.compute_w)
    model_flops, hardware_flops = flops_per_step(model, layout, global_batch)
    compute, optimizer = m * (mb.compute_f + mb.compute_b), _optimizer(model, layout, cluster)
    tp_comm, cp_comm, pp_comm = m * (mb.tp_f + mb.tp_b), m * (mb.cp_f + mb.cp_b), m * (mb.pp_f + mb.pp_b)
    return Timing(
        compute=compute,
        tp_comm=tp_comm,
        cp_comm=cp_comm,
        pp_comm=pp_comm,
        bubble=bubble,
        dp_comm=dp.total(m),
        optimizer=optimizer,
        shared_cores=_shared_cores(model, layout, cluster, mb, dp, m, compute + bubble + optimizer,
                                   tp_comm + cp_comm + pp_comm + dp.total(m), optimizer),
        model_flops=model_flops,
        hardware_flops=hardware_flops,
    )
