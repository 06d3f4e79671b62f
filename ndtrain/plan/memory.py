"""Memory per rank: model states (ZeRO stages 0–3) and activations (Korthikanti 2022), per stage.

Model states (Rajbhandari 2020, §3 and Figure 1). Ψ = parameters held by the rank's stage / tp,
N = dp·cp (context-parallel ranks hold the same parameters, so they shard ZeRO state too), and
per-parameter bytes 2 + 2 + K with K = 12 (bf16 weights, bf16 gradients, fp32 master + Adam):
    stage 0   2Ψ + 2Ψ + KΨ
    stage 1   2Ψ + 2Ψ + KΨ/N
    stage 2   2Ψ + 2Ψ/N + KΨ/N
    stage 3   (2 + 2 + K)Ψ/N  +  the gathered working set of two layers (current + prefetch)
On a CPU host (a calibrated profile) DDP's gradient buckets are slots of a shared-memory segment
(dist/host_slots.py, `parallel.host_shared_memory`, the default): averaging, a rank reads and writes
chunk r of each of its N − 1 peers' slots, so its resident set, which the trainer reports as its
peak, also counts those pages: (N−1)/N · the gradients' bytes more (measured: RssShmem 137 MiB =
1.5 × 91 MiB per rank at dp2). Physically they are the peers' gradients, counted once per rank here
because the resident set counts them so. ZeRO-1 and ZeRO-3 stream through a few MB of segments (left
out); ZeRO-2's pool of staging segments (host_buckets.py) is not counted.
Ψ of the first stage includes the embedding, of the last the output head (a second copy of
a tied embedding when pp > 1). With experts Ψ counts every expert (held, not active, parameters),
and ZeRO-3's working set is two of the largest layers.

Activations of one layer for one micro-batch of b sequences, s' = s/cp local tokens, in
bytes with value size β (Korthikanti 2022 §4, eq. 1–2, for β = 2 and gpt: 34·s·b·h + 5·a·s²·b):
    sbh·(R/t_R + S/t) + a·s'·s·b·Z/t     t_R = t with sequence parallelism, else 1
where R (values and masks replicated across tp: norms' inputs, the inputs of QKV and of the
MLP, dropout masks), S (tp-sharded: Q, K, V, the attention projection's input, the MLP's
intermediates) and Z (the score matrix: softmax output, dropout mask and output) are, per arch:
    gpt     R = 4β + 2,   S = β·(2 + 2k/a + 2f/h),   Z = 2β + 1     (34 and 5 for k=a, f=4h, β=2)
    llama   R = 4β,       S = β·(2 + 2k/a + 3f/h)                   (no dropout; fused SwiGLU keeps
                                                                      w1·x, w3·x and the product)
    llama, run by transformers' eager modules (`ModelSpec.hf`, `--model hf:DIR`; measured with
    saved-tensor hooks on LlamaDecoderLayer at fp32, tests/test_plan_hf_memory.py):
            R = 4β + 2·(4 + c),   S = β·(2 + 2k/a + 4f/h)
        each RMSNorm (LlamaRMSNorm computes in fp32) also keeps its normalised input x·rsqrt(mean x²)
        in fp32 (4 bytes) and, when β < 4, the fp32 copy of its input (c = 4, else 0); the unfused
        SwiGLU keeps act(w1·x) beside w1·x, w3·x and the product. SDPA's output is the attention
        projection's input (no copy), rotary cos/sin (2·s·b·d, shared by all layers) are left out.
        Family-specific: measured for transformers' Llama (Mistral, Qwen2 and the other llama-style
        families that copy its RMSNorm and MLP are counted the same; a family whose layers keep
        more, e.g. Gemma's extra norms, is under-counted); gpt-style HF models keep the gpt count.
With experts (moe.py) f is what a token spans, k·f_e + f_s, and R gains β·(2k + 2E/h) on MoE
layers (the token copies sent to the experts, their outputs, the router's logits and probabilities).
and Z = 0 for flash attention, which stores no scores (llama's default; gpt with `flash`).
k/a is the GQA adjustment: K and V are k/a the size of Q. Recompute (Korthikanti §5):
    selective  drops the Z term (scores are recomputed in the backward)
    full       keeps only each layer's input, β·sbh/t_R, plus one layer's full activations as
               the working set of the layer being recomputed
Per stage: (layers of the stage) × (micro-batches in flight, `schedules.py`) × one layer, plus
Korthikanti eq. 5's extras: the embedding dropout mask sbh/t_R per micro-batch in flight on
the first stage (gpt), and the output layer and loss 2β·sb(h + V)/t on the last (4sbh/t·(1+V/h)).

Overhead: the sum × (1 + FRAGMENTATION) plus the device's reserved bytes (runtime context,
communication buffers). FRAGMENTATION = 0.10 is a stated allowance for the caching allocator's
fragmentation, not a fitted value. On a calibrated CPU the reserved bytes are the resident set of a
process set up as an `ndtrain train` worker of the model's kind (`cpu_profile.CpuProfile.baseline`:
an `hf:` worker also holds transformers' modules, ~150 MiB more).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.plan import schedules
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster, Precision
from ndtrain.plan.layout import Layout

FRAGMENTATION = 0.10
GIB = 1024**3


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    stage: str  # which stage is the largest: "first", "last" or "only"

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead

    def gib(self) -> dict[str, float]:
        parts = ("params", "grads", "optimizer", "activations", "overhead", "total")
        return {name: round(getattr(self, name) / GIB, 3) for name in parts}


def layer_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, recompute: str) -> float:
    """Bytes one layer keeps for the backward of one micro-batch on one rank."""
    beta = precision.activation_bytes
    t, t_r = layout.tp, (layout.tp if layout.sp else 1)
    s_local = model.seq / layout.cp
    sbh = s_local * layout.mbs * model.hidden
    if recompute == "full":
        return beta * sbh / t_r
    replicated, sharded, scores = activation_coefficients(model, beta)
    total = sbh * (replicated / t_r + sharded / t)
    if recompute == "none":
        total += model.heads * s_local * model.seq * layout.mbs * scores / t
    return total


def activation_coefficients(model: ModelSpec, beta: int) -> tuple[float, float, float]:
    """(R, S, Z) of the module docstring, in bytes per s·b·h (R, S) and per a·s²·b (Z)."""
    kv, ffn = model.kv_ratio, model.token_ffn / model.hidden
    scores = 0 if model.flash_attention else 2 * beta + 1
    if model.arch == "gpt":
        return 4 * beta + 2, beta * (2 + 2 * kv + 2 * ffn), scores
    replicated, sharded = 4 * beta, beta * (2 + 2 * kv + 3 * ffn)
    if model.hf:  # transformers' eager layers: the norms' fp32 intermediates and act(w1·x) (module docstring)
        replicated += 2 * (4 + (4 if beta < 4 else 0))
        sharded += beta * ffn
    if model.moe is not None:  # the experts' token copies, outputs and router values (moe.py), mean over layers
        share = model.moe.moe_layers(model.layers) / model.layers
        replicated += share * beta * model.moe.replicated_values(model.hidden)
    return replicated, sharded, scores


def stage_params(model: ModelSpec, layout: Layout, stage: str) -> float:
    """Ψ: parameters one rank of this stage holds before ZeRO sharding."""
    layers = model.layers if layout.pp == 1 else layout.stage_layers(model.layers)
    total = model.layers_params(model.layers - layers if stage == "last" else 0, layers)
    if stage in ("first", "only"):
        total += model.embedding_params
    if stage in ("last", "only"):
        total += model.head_params
        if model.tied_embeddings and stage == "last":
            total += model.output_matrix_params
    return total / layout.tp


def model_states(model: ModelSpec, layout: Layout, precision: Precision, stage: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for the layout's ZeRO stage."""
    psi = stage_params(model, layout, stage)
    n = layout.dp * layout.cp
    params, grads, optimizer = psi * precision.param_bytes, psi * precision.grad_bytes, psi * precision.optimizer_bytes
    if layout.zero >= 1:
        optimizer /= n
    if layout.zero >= 2:
        grads /= n
    if layout.zero >= 3:
        params /= n
        gathered = 2 * model.largest_layer_params / layout.tp  # the layer computing + the one prefetched
        params += gathered * precision.param_bytes
        grads += gathered * precision.grad_bytes
    return params, grads, optimizer


def host_slot_pages(layout: Layout, cluster: Cluster, grads: float) -> float:
    """Bytes of the peers' shared gradient slots a DDP rank's resident set counts on a CPU host (module
    docstring): (N−1)/N · its gradients' bytes under zero 0 with N = dp·cp > 1, else 0."""
    n = layout.dp * layout.cp
    if cluster.hardware.kind != "cpu" or layout.zero != 0 or n == 1:
        return 0.0
    return (n - 1) / n * grads


def stage_activations(model: ModelSpec, layout: Layout, precision: Precision, micro_batches: int, stage: str) -> float:
    p, v, m = layout.pp, layout.vpp, micro_batches
    layers = model.layers if p == 1 else layout.stage_layers(model.layers)
    if stage == "last":
        in_flight = schedules.last_stage_in_flight(layout.schedule, p, m)
    else:
        in_flight = schedules.first_stage_in_flight(layout.schedule, p, m, v)
    per_layer = layer_activation_bytes(model, layout, precision, layout.recompute)
    total = in_flight * layers * per_layer
    if layout.recompute == "full":
        total += layer_activation_bytes(model, layout, precision, "none")
    beta = precision.activation_bytes
    tokens = model.seq / layout.cp * layout.mbs
    t_r = layout.tp if layout.sp else 1
    if stage in ("first", "only") and model.arch == "gpt":
        total += in_flight * tokens * model.hidden / t_r  # embedding dropout mask, 1 byte per value
    if stage in ("last", "only"):
        total += 2 * beta * tokens * (model.hidden + model.vocab) / layout.tp
    return total


def reserved_bytes(cluster: Cluster, model: ModelSpec) -> float:
    """What a rank holds before the model: a calibrated CPU's measured worker baseline for the model's
    kind, else the device's stated reserve."""
    cpu = cluster.hardware.cpu
    return cpu.baseline(model) if cpu is not None else cluster.hardware.reserved_bytes


def memory(model: ModelSpec, layout: Layout, cluster: Cluster, micro_batches: int) -> Memory:
    """The rank with the most memory: the first or the last pipeline stage."""
    precision = cluster.hardware.precision
    stages = ("only",) if layout.pp == 1 else ("first", "last")
    candidates = []
    for stage in stages:
        params, grads, optimizer = model_states(model, layout, precision, stage)
        grads += host_slot_pages(layout, cluster, grads)
        activations = stage_activations(model, layout, precision, micro_batches, stage)
        subtotal = params + grads + optimizer + activations
        overhead = FRAGMENTATION * subtotal + reserved_bytes(cluster, model)
        candidates.append(Memory(params, grads, optimizer, activations, overhead, stage))
    return max(candidates, key=lambda mem: mem.total)
