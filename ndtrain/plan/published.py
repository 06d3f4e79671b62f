"""Published training runs, the planner's check at cluster scale: every row read in its source.

Each row is a run's model, GPU, layout and batch as its source states them and the throughput it
reports, and the bytes per gradient value its data-parallel reduction moves where the run's
framework settings say so (`grad_reduce_bytes`: 4 for an fp32 reduction). Where the source leaves a
detail out, `assumed` says what the planner takes. The numbers
were read in the sources named by `where` (repository path at a commit, or page, and the table);
docs/planner.md lists them with every row's prediction.

Throughput is compared in the unit the source measured:
    tokens     tokens per second per GPU (measured directly: llm-foundry's "Throughput (T/s/GPU)",
               torchtitan's WPS, or global batch × sequence / seconds per iteration / GPUs)
    model      model TFLOP/s per GPU (MFU × datasheet peak; no recompute, Korthikanti 2022 §6)

Fit and held-out rows: by source order (the order of `RUNS`), every third row (index 2, 5, 8, …)
is held out; the efficiency constants of `efficiency.py` were fitted on the other rows only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ndtrain.plan.arch import PRESETS, ModelSpec
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.hardware import Cluster, gpu
from ndtrain.plan.layout import Layout
from ndtrain.plan.timing import Timing, step_time

HOLD_OUT_EVERY = 3  # rows 2, 5, 8, ... of RUNS (0-based) are held out of the fit


@dataclass(frozen=True)
class PublishedRun:
    source: str  # short name of the source and row
    where: str  # where the numbers were read: repository/path@commit or page, and the table
    model: ModelSpec
    gpu: str
    layout: Layout
    global_batch: int
    reported: float
    metric: str  # "tokens" (tokens/s/GPU) or "model" (model TFLOP/s/GPU)
    assumed: str = ""
    inter_bw_gbs: float | None = None
    grad_reduce_bytes: int = 2  # bytes per gradient value the data-parallel reduction moves, as the run set it

    def timing(self, efficiency: GpuEfficiency | None = None) -> Timing:
        hardware = gpu(self.gpu, inter_bw_gbs=self.inter_bw_gbs)
        if efficiency is not None:
            hardware = replace(hardware, efficiency=efficiency)
        if self.grad_reduce_bytes != hardware.precision.grad_bytes:
            hardware = replace(hardware, precision=replace(hardware.precision, grad_bytes=self.grad_reduce_bytes))
        return step_time(self.model, self.layout, Cluster(hardware, self.layout.world, 8), self.global_batch)

    def predicted(self, efficiency: GpuEfficiency | None = None) -> float:
        timing = self.timing(efficiency)
        if self.metric == "tokens":
            return self.global_batch * self.model.seq / timing.step / self.layout.world
        return timing.model_flops / timing.step / self.layout.world / 1e12

    def error(self) -> float:
        return self.predicted() / self.reported - 1


def held_out(index: int) -> bool:
    return index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, flash: bool) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, heads, 4 * hidden, vocab, seq, flash)


def _fsdp(gpus: int, mbs: int, recompute: str) -> Layout:
    """FSDP FULL_SHARD / FSDP2: data parallel with every state sharded (ZeRO-3)."""
    return Layout(1, 1, gpus, 1, 3, mbs, 1, recompute, False, "none")


def _megatron(tp: int, pp: int, dp: int, mbs: int, recompute: str, sp: bool, zero: int) -> Layout:
    return Layout(tp, pp, dp, 1, zero, mbs, 1, recompute, sp, "1f1b" if pp > 1 else "none")


# --- mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 061f2c7 -----------------------
# MPT: GeLU MLP 4h, tied embedding, learned positions (NumParams grows with SeqLen), vocab 50368,
# attn_impl flash (scripts/train/yamls/pretrain/mpt-*.yaml @ 8c8dd48). Rows: SeqLen 2048, MPT 7b
# and larger, bf16 (amp_bf16 or bf16 PURE), FULL_SHARD; Activation Checkpointing True → full.
_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md@061f2c7"
_MPT = {
    "7b": _gpt("mpt-7b", 32, 4096, 32, 50368, 2048, True),
    "13b": _gpt("mpt-13b", 40, 5120, 40, 50368, 2048, True),
    "30b": _gpt("mpt-30b", 48, 7168, 56, 50368, 2048, True),
    "70b": _gpt("mpt-70b", 80, 8192, 64, 50368, 2048, True),
}
_FOUNDRY_ASSUMED = "inter-node link: the planner's default per GPU"
# The table's "MP Mode" column: Composer's FSDP mixed precision (composer/trainer/mosaic_fsdp_utils.py
# `get_mixed_precision` @ v0.16.4, the release llm-foundry's setup.py pinned, >=0.16.4,<0.17, when the
# tables were written): DEFAULT gathers bf16 parameters but reduce-scatters gradients in fp32
# (reduce_dtype float32); PURE does both in bf16.
_COMPOSER_REDUCE_BYTES = {"DEFAULT": 4, "PURE": 2}


def _mpt(table: str, gpu_name: str, size: str, gpus: int, mbs: int, batch: int, ac: bool, tps: float,
         inter_bw_gbs: float | None = None, mp_mode: str = "DEFAULT") -> PublishedRun:
    return PublishedRun(f"llm-foundry {table} MPT-{size} {gpus} GPUs", f"{_FOUNDRY}, table '{table}'", _MPT[size],
                        gpu_name, _fsdp(gpus, mbs, "full" if ac else "none"), batch, tps, "tokens",
                        _FOUNDRY_ASSUMED, inter_bw_gbs, _COMPOSER_REDUCE_BYTES[mp_mode])


_H100 = "H100 80GB BF16"
_A100 = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
_ROCE = 200 / 8  # 1600 Gb/s per node of 8 GPUs = 25 GB/s per GPU

FOUNDRY_RUNS = (
    _mpt(_H100, "h100-sxm", "70b", 64, 8, 2048, True, 1039),
    _mpt(_H100, "h100-sxm", "70b", 32, 2, 1024, True, 882),
    _mpt(_H100, "h100-sxm", "30b", 32, 14, 1344, True, 2308),
    _mpt(_H100, "h100-sxm", "30b", 16, 10, 480, True, 2263),
    _mpt(_H100, "h100-sxm", "30b", 8, 3, 504, True, 2002),
    _mpt(_H100, "h100-sxm", "13b", 64, 2, 128, False, 4800),
    _mpt(_H100, "h100-sxm", "13b", 32, 2, 64, False, 4811),
    _mpt(_H100, "h100-sxm", "13b", 16, 2, 32, False, 4767),
    _mpt(_H100, "h100-sxm", "13b", 8, 2, 16, False, 4792),
    _mpt(_H100, "h100-sxm", "7b", 8, 6, 48, False, 10643),
    _mpt(_A100, "a100-80gb", "70b", 64, 8, 2048, True, 410, _ROCE, "PURE"),
    _mpt(_A100, "a100-80gb", "70b", 32, 2, 1024, True, 373, _ROCE, "PURE"),
    _mpt(_A100, "a100-80gb", "30b", 8, 3, 504, True, 916, _ROCE),
    _mpt(_A100, "a100-80gb", "13b", 8, 2, 48, False, 2262, _ROCE),
    _mpt(_A100, "a100-80gb", "7b", 8, 6, 96, False, 4641, _ROCE),
)

# --- pytorch/torchtitan docs/performance.md @ 0413364 -----------------------------------------
# FSDP2 on 64 A100 80GB, WPS per GPU; local batch size = mbs, global = 64 × local. "selective op"
# checkpointing saves the matmul outputs: costed as no recompute beyond flash attention's. Gradients
# are reduce-scattered in fp32 (torchtitan/parallelisms/parallelize_llama.py @ 0413364:
# MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)).
_TITAN = "pytorch/torchtitan docs/performance.md@0413364"


def _titan(table: str, name: str, mbs: int, recompute: str, wps: float) -> PublishedRun:
    return PublishedRun(f"torchtitan {table} {name} {recompute}", f"{_TITAN}, table '{table}'", PRESETS[name],
                        "a100-80gb", _fsdp(64, mbs, recompute), 64 * mbs, wps, "tokens",
                        "torch.compile off; inter-node link: the planner's default per GPU", grad_reduce_bytes=4)


TITAN_RUNS = (
    _titan("LLaMa 3 performance numbers", "llama3-8b", 1, "selective", 2973),
    _titan("LLaMa 3 performance numbers", "llama3-70b", 1, "full", 331),
    _titan("LLaMa 2 performance numbers", "llama2-13b", 2, "none", 2162),
    _titan("LLaMa 2 performance numbers", "llama2-70b", 2, "full", 353),
)

# --- bigscience-workshop/bigscience train/tr11-176B-ml @ 9e64ede -------------------------------
# 48 nodes of 8 A100 80GB, 4 × 100 Gb/s Omni-Path per node (6.25 GB/s per GPU), Megatron-DeepSpeed
# with ZeRO-1, full activation checkpointing, no SP, sequence 2048, vocabulary 250880 (padded).
_BIGSCIENCE = "bigscience-workshop/bigscience train/tr11-176B-ml/"
_OPA = 50 / 8
_BLOOM = _gpt("bloom-176b", 70, 14336, 112, 250880, 2048, False)
_BLOOM_181B = _gpt("bloom-181b-trial", 72, 14336, 64, 250880, 2048, False)


def _bloom_trial(tp: int, pp: int, dp: int, mbs: int, seconds: float) -> PublishedRun:
    return PublishedRun(f"BigScience 181B trial tp{tp} pp{pp} dp{dp} mbs{mbs}",
                        f"{_BIGSCIENCE}chronicles-prequel.md@9e64ede, 'GBS Variations' (2022-02-25 tables)",
                        _BLOOM_181B, "a100-80gb", _megatron(tp, pp, dp, mbs, "full", False, 1), 2048,
                        2048 * 2048 / seconds / 384, "tokens", "vocabulary 250880 (the '250k' of these trials)",
                        _OPA)


BIGSCIENCE_RUNS = (
    PublishedRun("BigScience BLOOM-176B production", f"{_BIGSCIENCE}README.md@9e64ede, 'Important checkpoints': "
                 "104.70 s/iteration (149.77 TFLOPs) at GBS 2048; layout from 'Replica setup'", _BLOOM, "a100-80gb",
                 _megatron(4, 12, 8, 2, "full", False, 1), 2048, 2048 * 2048 / 104.70 / 384, "tokens", "", _OPA),
    _bloom_trial(4, 12, 8, 2, 110.48),
    _bloom_trial(4, 6, 16, 2, 111.71),
    _bloom_trial(2, 12, 16, 2, 112.50),
    _bloom_trial(8, 6, 8, 4, 114.11),
    _bloom_trial(8, 12, 4, 4, 117.07),
    _bloom_trial(2, 24, 8, 1, 119.53),
    _bloom_trial(4, 24, 4, 1, 130.60),
)

# --- Korthikanti et al. 2022 (arXiv 2205.05198), abstract, as stored at ar5iv.labs.arxiv.org ----
# "a 530B parameter GPT-3 style model on 2240 NVIDIA A100 GPUs ... Model Flops Utilization of
# 54.2%, which is 29% faster than the 42.1% we achieve using recomputation".
_GPT_530B = _gpt("gpt-530b", 105, 20480, 128, 51200, 2048, False)
_KORTHIKANTI = "https://ar5iv.labs.arxiv.org/html/2205.05198, abstract"
_KORTHIKANTI_ASSUMED = ("tp8 pp35 dp8 (2240 = 8·35·8, the 530B model's tp·pp), global batch 1920, mbs 1, 1F1B, "
                        "distributed optimizer (ZeRO-1), DGX A100 links")

KORTHIKANTI_RUNS = (
    PublishedRun("Korthikanti 2022, 530B, selective + SP", _KORTHIKANTI, _GPT_530B, "a100-80gb",
                 _megatron(8, 35, 8, 1, "selective", True, 1), 1920, 0.542 * 312, "model", _KORTHIKANTI_ASSUMED),
    PublishedRun("Korthikanti 2022, 530B, full recompute", _KORTHIKANTI, _GPT_530B, "a100-80gb",
                 _megatron(8, 35, 8, 1, "full", False, 1), 1920, 0.421 * 312, "model", _KORTHIKANTI_ASSUMED),
)

# --- nv-adlr/nv-adlr.github.io _projects/megatron-lm-v1.md @ 1576088 (Megatron v1.0, 2020) -----
# 1.2B baseline on one V100 of a DGX-2H: 1288 ms per iteration (Table 1), batch 8; its config
# (h 1536, 16 heads, 40 layers, vocabulary 51,200) from _projects/megatron-lm.md @ 0725124, Table 1.
_MEGATRON_V1 = _gpt("megatron-1.2b", 40, 1536, 16, 51200, 1024, False)

V100_RUNS = (
    PublishedRun("Megatron v1.0, 1.2B on 1 V100", "nv-adlr/nv-adlr.github.io _projects/megatron-lm-v1.md@1576088, "
                 "Table 1 (1288 ms/iteration)", _MEGATRON_V1, "v100-sxm3",
                 _megatron(1, 1, 1, 8, "full", False, 0), 8, 8 * 1024 / 1.288, "tokens",
                 "sequence 1024 (GPT-2's), fp16 with activation checkpointing (Megatron 2019 practice)"),
)

RUNS: tuple[PublishedRun, ...] = FOUNDRY_RUNS + TITAN_RUNS + BIGSCIENCE_RUNS + KORTHIKANTI_RUNS + V100_RUNS

# Layouts of one model a source compares: (source, rows fastest first as measured).
ORDERINGS: tuple[tuple[str, tuple[PublishedRun, ...]], ...] = (
    ("BigScience 181B trials (TP4 chosen over TP8 and TP2)", BIGSCIENCE_RUNS[1:]),
    ("Korthikanti 2022: selective + SP faster than full recompute", KORTHIKANTI_RUNS),
)
