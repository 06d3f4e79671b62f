"""Published runs of Megatron-LM and its descendants (Megatron-DeepSpeed, NeMo, Megatron-Bridge).

Each source's stack, read in its code or documents:
    Megatron v1.0   NVIDIA/Megatron-LM tag v1.0 (2020-04-21; the blog is dated 2020-05-15 and the master
    (V100)          merges between add no kernel), megatron/model/transformer.py: apex FusedLayerNorm,
                    F.gelu (language_model.py; the jit-scripted openai_gelu only with --openai-gelu),
                    attention as torch.matmul of pre-scaled q and k + masked_fill_ + softmax + dropout,
                    the row-parallel bias, dropout and the residual add as separate kernels: `eager`,
                    dense attention. The fused scale-mask-softmax, bias-GeLU and bias-dropout-add came
                    in 51a2e6b "Various speed optimizations" (2020-09-11).
    BigScience      Megatron-DeepSpeed with the fused kernels (`--abort-on-unmet-fused-kernel-constraints`
    BLOOM           in train/tr11-176B-ml/tr11-176B-ml.slurm): fused scale-mask-softmax, bias-GeLU,
                    bias-dropout-add (default dropout 0.1), dense attention, and ALiBi (`--position-
                    embedding-type alibi`) added to the scores through baddbmm's input: `fused (ALiBi)`;
                    DeepSpeed's pipeline engine partitions each boundary over the tp group and
                    all-gathers it on arrival (`is_pipe_partitioned`), as Megatron's scatter/gather
    Narayanan       Megatron-LM 2021 (arXiv 2104.04473 §4.2: bias-GeLU and bias-dropout-add fused by the
    (2021)          PyTorch JIT, the fused scale-mask-softmax), fp16, dense attention: `fused`
    Korthikanti     Megatron-LM 2022 (the same fusions), dense attention: `fused`
    Megatron-LM     Megatron-Core with Transformer Engine, `--tp-comm-overlap`, `--overlap-grad-reduce
    (H100, 2024)    --overlap-param-gather` (README 'Training Speed and Scalability'): `fused`, TP overlapped
    NeMo 24.07      Megatron-Core with Transformer Engine in FP8 (the table's precision): `fused-fp8`
    Megatron-Bridge NeMo 25.11 container, FP8 current scaling with FP8 parameter gathers, TP
                    communication overlapped (userbuffers) where tp > 1, Transformer Engine's fused
                    cross-entropy: `fused-fp8 (TE cross-entropy)` (held out)
Megatron's distributed optimizer is ZeRO-1 (gradients reduce-scattered, parameters all-gathered); with
tp > 1 the Megatron-Core runs use sequence parallelism (`--tp-comm-overlap` requires it).
"""

from __future__ import annotations

from dataclasses import replace

from ndtrain.plan.arch import PRESETS, ModelSpec
from ndtrain.plan.kernels import EAGER, FUSED, FUSED_FP8
from ndtrain.plan.published_run import PublishedRun, Source, megatron, megatron_tokens


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, flash: bool) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, heads, 4 * hidden, vocab, seq, flash)


# --- bigscience-workshop/bigscience train/tr11-176B-ml @ 9e64ede -------------------------------
# 48 nodes of 8 A100 80GB, 4 Omni-Path NICs of 100 Gb/s per node, Megatron-DeepSpeed with ZeRO-1, full
# activation checkpointing, no SP, sequence 2048, vocabulary 250880 (padded).
BIGSCIENCE = Source(
    "BigScience", "BigScience BLOOM-176B training (tr11) and its 181B layout trials",
    "bigscience-workshop/bigscience train/tr11-176B-ml/README.md@9e64ede ('Important checkpoints', 'Replica "
    "setup') and chronicles-prequel.md@9e64ede ('GBS Variations', 2022-02-25 tables)",
    "Megatron-DeepSpeed, fused kernels, dense attention with ALiBi, ZeRO-1: fp16 in the 2022-02-25 trials, bf16 "
    "in production (profile fused, plus ALiBi's score-matrix copy)")
# The inter-node link as the source measured it, not the NICs' nominal 12.5 GB/s: NCCL 2.10.3 over
# Omni-Path on 4 of these nodes (experiments/bandwidth/all_reduce_bench-a100-n4.txt @ 9e64ede, 2022-01-27,
# 32 A100, a 4 GB fp32 all-reduce in the training's conda environment) reached busbw 40.5 Gb/s (the
# median of its 160 readings; trial 0, the warm-up, reads 15). Its log shows where that ran: 2 channels,
# both leaving every node through one NIC (NET/IB/3) and entering through another (NET/IB/1), so 40.5 Gb/s
# is what NCCL gets from one NIC in one direction. A node's 4 NICs serve its 8 GPUs: 5.07 · 4 / 8 per GPU.
_NICS_PER_GPU = 4 / 8
OPA_NOMINAL = 100 / 8 * _NICS_PER_GPU  # GB/s per GPU at the NICs' 100 Gb/s (the ablation's alternative)
_OPA = 40.5 / 8 * _NICS_PER_GPU
# DeepSpeed's pipeline engine (microsoft/DeepSpeed deepspeed/runtime/pipe/engine.py @ v0.5.10, the
# last release before the trials, lines 130-132, 634-652 and 613-624; the same in every later release, as
# the `pipe_partitioned` default) partitions a stage's output over the tp group (PartitionedTensor: each
# tp rank sends 1/t) and the next stage all-gathers it (`.full()`); gradients likewise: scatter/gather.
# Its TrainSchedule (deepspeed/runtime/pipe/schedule.py @ v0.5.10) reduces the gradients at the end of the
# batch, after the last backward (ReduceTiedGrads, ReduceGrads, OptimizerStep): dp_overlap=False.
# ALiBi as bigscience-workshop/Megatron-DeepSpeed runs it (megatron/model/transformer.py @ 99c8fe0, the
# code of 2022-02-25, lines 283-326 and 591-618): the bias is a (b·np, 1, s) tensor passed as baddbmm's
# input with beta = 1 (or 1/layer_number) instead of an empty one with beta = 0. PyTorch's baddbmm
# (aten/src/ATen/native/cuda/Blas.cpp @ 002253c, baddbmm_out_cuda) expands it to (b·np, s, s) and, as
# beta != 0, copies it into the result before the batched GEMM, which then reads it as C: per score
# element a 2-byte write and a 2-byte read that the fused profile's chain (QKᵀ's write, the fused
# softmax, AV's read: 8) does not have. Forward bytes, as every profile counts them.
_FUSED_ALIBI = replace(FUSED, name="fused (ALiBi)", scores=FUSED.scores + 4)
_BLOOM = _gpt("bloom-176b", 70, 14336, 112, 250880, 2048, False)
_BLOOM_181B = _gpt("bloom-181b-trial", 72, 14336, 64, 250880, 2048, False)


def _bloom(name: str, where: str, model: ModelSpec, tp: int, pp: int, dp: int, mbs: int, seconds: float,
           assumed: str = "") -> PublishedRun:
    """A run on BigScience's 384 A100 at GBS 2048, with its stack and its measured network."""
    return PublishedRun(BIGSCIENCE, name, where, model, "a100-80gb", megatron(tp, pp, dp, mbs, "full", False, 1), 2048,
                        2048 * 2048 / seconds / 384, _FUSED_ALIBI, assumed, _OPA, pp_scatter_gather=True,
                        dp_overlap=False)


def _bloom_trial(tp: int, pp: int, dp: int, mbs: int, seconds: float) -> PublishedRun:
    return _bloom(f"181B trial tp{tp} pp{pp} dp{dp} mbs{mbs}", f"{seconds} s/iteration", _BLOOM_181B, tp, pp, dp,
                  mbs, seconds, "vocabulary 250880 (the '250k' of these trials)")


BLOOM_TRIALS = (
    _bloom_trial(4, 12, 8, 2, 110.48),
    _bloom_trial(4, 6, 16, 2, 111.71),
    _bloom_trial(2, 12, 16, 2, 112.50),
    _bloom_trial(8, 6, 8, 4, 114.11),
    _bloom_trial(8, 12, 4, 4, 117.07),
    _bloom_trial(2, 24, 8, 1, 119.53),
    _bloom_trial(4, 24, 4, 1, 130.60),
)
BIGSCIENCE_RUNS = (
    _bloom("BLOOM-176B production", "104.70 s/iteration (149.77 TFLOPs) at GBS 2048", _BLOOM, 4, 12, 8, 2, 104.70),
    *BLOOM_TRIALS,
)

# --- Korthikanti et al. 2022 (arXiv 2205.05198), abstract, as stored at ar5iv.labs.arxiv.org ----
# "a 530B parameter GPT-3 style model on 2240 NVIDIA A100 GPUs ... Model Flops Utilization of
# 54.2%, which is 29% faster than the 42.1% we achieve using recomputation".
KORTHIKANTI = Source(
    "Korthikanti 2022", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models",
    "https://ar5iv.labs.arxiv.org/html/2205.05198, abstract", "Megatron-LM 2022, fused kernels, dense attention "
    "(profile fused)")
_GPT_530B = _gpt("gpt-530b", 105, 20480, 128, 51200, 2048, False)
_KORTHIKANTI_ASSUMED = ("tp8 pp35 dp8 (2240 = 8·35·8, the 530B model's tp·pp), global batch 1920, mbs 1, 1F1B, "
                        "distributed optimizer (ZeRO-1), DGX A100 links, pipeline boundaries scattered over tp "
                        "(Megatron-LM's default --scatter-gather-tensors-in-pipeline), gradients reduced after the "
                        "backward (Megatron-LM's train_step of 2022)")


def _korthikanti(name: str, mfu: float, recompute: str, sp: bool) -> PublishedRun:
    return PublishedRun(KORTHIKANTI, name, f"MFU {100 * mfu:.1f} % of 312 TFLOP/s", _GPT_530B, "a100-80gb",
                        megatron(8, 35, 8, 1, recompute, sp, 1), 1920, megatron_tokens(_GPT_530B, mfu * 312),
                        FUSED, _KORTHIKANTI_ASSUMED, pp_scatter_gather=True, dp_overlap=False)


KORTHIKANTI_RUNS = (
    _korthikanti("530B, selective + SP", 0.542, "selective", True),
    _korthikanti("530B, full recompute", 0.421, "full", False),
)

# --- Narayanan et al. 2021 (arXiv 2104.04473, SC21), §5 and Table 1 ------------------------------
# Selene: DGX A100 nodes of 8 A100 80GB on NVLink/NVSwitch, 8 HDR InfiniBand HCAs of 200 Gb/s per node
# for the application (§5); mixed precision (fp16). Table 1 ("Weak-scaling throughput for GPT models"):
# vocabulary 51,200, sequence 2048, activation recomputation (eq. 3, the count of its TFLOP/s per GPU,
# includes the recomputed forward). Rows with pp = 1 only: the pp > 1 rows run the interleaved schedule
# (§5.1) with neither its chunks nor the micro-batch size stated, which set a pipeline's bubble (the rule
# of the Megatron-LM 2024 rows). At pp = 1 the data-parallel group is tp-major as in every layout here.
NARAYANAN = Source(
    "Narayanan 2021", "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM", "arXiv 2104.04473 (SC21), §5 and Table 1", "Megatron-LM 2021, fused kernels (§4.2), "
    "dense attention, fp16, full recompute (profile fused)")
_NARAYANAN_ASSUMED = ("micro-batch 1 (not stated; the paper's own choice in its §5.4 experiments), dropout 0.1 "
                      "(Megatron's default), gradients all-reduced in fp16 without a distributed optimizer "
                      "(ZeRO-0), DGX A100 links")
# Megatron-LM of 2021-22 (megatron/training.py train_step @ aed2f75, 2021-04-11, and @ 35a3fa8, 2022-05-13)
# all-reduces the gradients after forward_backward_func returns (`allreduce_gradients`, --DDP-impl local,
# the default): nothing overlaps them (dp_overlap=False; Megatron-Core's --overlap-grad-reduce came later).


def _narayanan(size: str, heads: int, hidden: int, layers: int, tp: int, gpus: int, batch: int,
               tflops: float) -> PublishedRun:
    spec = _gpt(f"gpt-{size.lower()}-narayanan", layers, hidden, heads, 51200, 2048, False)
    return PublishedRun(NARAYANAN, f"{size} tp{tp} on {gpus} GPUs", f"{tflops} TFLOP/s per GPU (eq. 3)", spec,
                        "a100-80gb", megatron(tp, 1, gpus // tp, 1, "full", False, 0), batch,
                        megatron_tokens(spec, tflops, recompute=True), FUSED, _NARAYANAN_ASSUMED, dp_overlap=False)


NARAYANAN_RUNS = (
    _narayanan("1.7B", 24, 2304, 24, 1, 32, 512, 137),
    _narayanan("3.6B", 32, 3072, 30, 2, 64, 512, 138),
    _narayanan("7.5B", 32, 4096, 36, 4, 128, 512, 142),
    _narayanan("18.4B", 48, 6144, 40, 8, 256, 1024, 135),
)

# --- nv-adlr/nv-adlr.github.io _projects/megatron-lm-v1.md @ 1576088 (Megatron v1.0, 2020) -----
# 1.2B baseline on one V100 of a DGX-2H: 1288 ms per iteration (Table 1), batch 8; its config
# (h 1536, 16 heads, 40 layers, vocabulary 51,200) from _projects/megatron-lm.md @ 0725124, Table 1.
# The post (f12a38d, dated 2020-05-15) credits "several software optimizations" in "version 1.0 of
# Megatron-lm in our github repository": NVIDIA/Megatron-LM tag v1.0 (03d2880, 2020-04-21), whose
# optimizations over the 2019 code are multi-tensor-apply in the fp16 optimizer (9941026), torch's
# gelu (3ea5491), gradients reset to None (3a70158) and binary masks with masked_fill_ (8ceed7c), all
# of 2020-04-14; the master merges up to the post add no kernel. The post's own "62.4 teraFLOPs" is
# 1.383 s per iteration by the 2019 paper's count (96·B·s·l·h²·(1 + s/6h + V/16lh)), 7 % slower than
# Table 1's 1288 ms: the row reads Table 1.
MEGATRON_V1 = Source(
    "Megatron v1.0", "MegatronLM's Supercharged V1.0 (NVIDIA ADLR blog, 2020)",
    "nv-adlr/nv-adlr.github.io _projects/megatron-lm-v1.md@1576088, Table 1; configuration from "
    "_projects/megatron-lm.md@0725124, Table 1", "Megatron-LM v1.0: apex LayerNorm, unfused softmax and "
    "dropout, dense attention, fp16 (profile eager)")
_MEGATRON_1_2B = _gpt("megatron-1.2b", 40, 1536, 16, 51200, 1024, False)
V100_RUNS = (
    PublishedRun(MEGATRON_V1, "1.2B on 1 V100", "1288 ms/iteration, batch 8", _MEGATRON_1_2B, "v100-sxm3",
                 megatron(1, 1, 1, 8, "full", False, 0), 8, 8 * 1024 / 1.288, EAGER,
                 "sequence 1024 (GPT-2's), fp16 with activation checkpointing (Megatron 2019 practice)"),
)

# --- NVIDIA/Megatron-LM README.md and images/model_table.png @ f2e5db4 (2024-07-15) -----------
# GPT models, vocabulary 131,072, sequence 4096, on H100 (DGX, 8 per node); per-GPU model TFLOP/s by
# Megatron's count. Rows with pp = 1 only: the table gives neither micro-batch size nor pipeline
# schedule, which set a pipeline's bubble.
MEGATRON_LM = Source(
    "Megatron-LM 2024", "Megatron-LM README, Training Speed and Scalability (weak scaling on H100)",
    "NVIDIA/Megatron-LM README.md@f2e5db4 and images/model_table.png@f2e5db4", "Megatron-Core + Transformer "
    "Engine, overlapped TP/DP communication (profile fused)")
_MEGATRON_LM_ASSUMED = ("GPT with a 4h MLP (the table's parameter counts), dropout 0.1 (Megatron's default), "
                        "micro-batch 1, no recompute, distributed optimizer, SP when tp > 1")


def _megatron_lm(size: str, heads: int, hidden: int, layers: int, tp: int, gpus: int, tflops: float) -> PublishedRun:
    spec = _gpt(f"gpt-{size.lower()}-v131k", layers, hidden, heads, 131072, 4096, True)
    return PublishedRun(MEGATRON_LM, f"{size} tp{tp} on {gpus} GPUs", f"{tflops} TFLOP/s per GPU", spec, "h100-sxm",
                        megatron(tp, 1, gpus // tp, 1, "none", tp > 1, 1), 192, megatron_tokens(spec, tflops), FUSED,
                        _MEGATRON_LM_ASSUMED, tp_overlap=True)


MEGATRON_LM_RUNS = (
    _megatron_lm("1.7B", 16, 2048, 24, 1, 48, 408.8),
    _megatron_lm("7.1B", 32, 4096, 30, 2, 96, 465.9),
    _megatron_lm("16B", 48, 6144, 32, 4, 192, 489.1),
    _megatron_lm("32B", 56, 7168, 48, 8, 384, 459.6),
)

# --- NVIDIA/NeMo docs/source/performance/performance_summary.md @ 8e3d65d (NeMo 24.07) ---------
# Pre-training at FP8 on DGX-H100; tokens/sec/GPU as reported. Rows of models with a preset here.
NEMO = Source(
    "NeMo 24.07", "NeMo performance summary, pre-training at FP8 (container 24.07, DGX-H100)",
    "NVIDIA/NeMo docs/source/performance/performance_summary.md@8e3d65d, table 'Pretraining'",
    "Megatron-Core + Transformer Engine FP8 (profile fused-fp8)")
_NEMO_ASSUMED = ("no recompute, distributed optimizer with its reduction and gather behind the compute "
                 "(Megatron-Core's overlap_grad_reduce/overlap_param_gather), SP when tp > 1, TP communication "
                 "not overlapped")


def _nemo(model: str, gpus: int, batch: int, mbs: int, tp: int, pp: int, cp: int, vpp: int, tps: float,
          seq: int | None = None) -> PublishedRun:
    spec = PRESETS[model]
    if model == "gpt3-175b":
        spec = ModelSpec(spec.name, "gpt", spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab,
                         spec.seq, flash=True)
    dp = gpus // (tp * pp * cp)
    return PublishedRun(NEMO, f"{model} {gpus} GPUs", f"{tps} tokens/sec/GPU", spec, "h100-sxm",
                        megatron(tp, pp, dp, mbs, "none", tp > 1, 1, cp, vpp), batch, tps, FUSED_FP8, _NEMO_ASSUMED)


NEMO_RUNS = (
    _nemo("gpt3-175b", 128, 256, 1, 4, 8, 1, 6, 716),
    _nemo("gpt3-175b", 512, 2048, 2, 4, 8, 1, 6, 825),
    _nemo("llama2-7b", 8, 128, 1, 1, 1, 1, 1, 16934),
    _nemo("llama2-13b", 16, 128, 1, 1, 4, 1, 10, 8715),
    _nemo("llama2-70b", 64, 128, 1, 4, 4, 1, 20, 1728),
    _nemo("llama3-8b", 8, 128, 1, 1, 1, 2, 1, 12273),
    _nemo("llama3-70b", 64, 128, 1, 4, 4, 2, 5, 1524),
)

# --- NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ 00b7660 (NeMo 25.11) ----------
# Held out: never used in any fit. Dense Llama rows of the DGX-H100 and DGX-B200 tables, FP8-CS
# (current scaling); FSDP = 1 is Megatron FSDP (ZeRO-3 over the data-parallel ranks). The stack as the
# performance scripts at the same commit set it ("results obtained using performance recipes"):
# - scripts/performance/utils/precision.py, fp8_cs: bf16_with_fp8_current_scaling_mixed() with
#   first_last_layers_bf16 = False (src/megatron/bridge/training/mixed_precision.py: fp8_param_gather
#   = True), so every ZeRO/FSDP parameter gather moves FP8 values;
# - src/megatron/bridge/recipes/llama/llama3.py, llama3_70b_pretrain_config and
#   llama31_405b_pretrain_config: CommOverlapConfig(tp_comm_overlap=True) with userbuffers, kept by
#   the H100 and B200 fp8_cs scripts (scripts/performance/configs/llama/llama3*_llm_pretrain.py);
# - the same recipes and scripts/performance/utils/overrides.py: cross_entropy_fusion_impl = "te",
#   Transformer Engine's Triton cross-entropy (transformer_engine/pytorch/triton/cross_entropy.py @ v2.9
#   and v2.10, the releases of the container's months): its forward reads each bf16 logit twice (the
#   online softmax, then the loss) and writes the gradient in its place: 6 bytes per logit, not 38
#   (its backward, an in-place multiply, moves 4, which the planner's uniform 2 × forward counts as 12);
# - the H100 8B row: the table's FSDP 1, cp 1 and no recompute are the 25.09 recipe's
#   (configs/llama3/llama3_8b_llm_pretrain.yaml@fa0315ae2, fp8_cs: use_megatron_fsdp, nccl_ub, whose
#   table row has the same layout); 00b7660's own llama3_workload_base_configs.py (after the 2025-12-03
#   launcher refactor) sets cp 1 and full recompute of 5 of 32 layers but not FSDP, contrary to its table.
MEGATRON_BRIDGE = Source(
    "Megatron-Bridge 25.11", "Megatron-Bridge performance summary, NeMo 25.11 container",
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md@00b7660, '25.11 NeMo Container', tables "
    "'System: DGX-H100' and 'System: DGX-B200'", "Megatron-Core + Transformer Engine FP8 current scaling "
    "with FP8 parameter gathers, TP communication overlapped where tp > 1, TE's fused cross-entropy (profile "
    "fused-fp8, loss 6 bytes per logit)", held_out=True)
_FUSED_FP8_TE_LOSS = replace(FUSED_FP8, name="fused-fp8 (TE cross-entropy)", loss=6)
_BRIDGE_ASSUMED = ("no recompute, distributed optimizer or Megatron FSDP with its reduction and gather behind the "
                   "compute (Megatron-Core's overlap_grad_reduce/overlap_param_gather), SP when tp > 1")


def _bridge(gpu: str, model: str, gpus: int, batch: int, mbs: int, zero: int, tp: int, pp: int, cp: int, vpp: int,
            tps: float) -> PublishedRun:
    dp = gpus // (tp * pp * cp)
    return PublishedRun(MEGATRON_BRIDGE, f"{gpu.upper()} {model} {gpus} GPUs", f"{tps} tokens/sec/GPU", PRESETS[model],
                        "h100-sxm" if gpu == "h100" else gpu, megatron(tp, pp, dp, mbs, "none", tp > 1, zero, cp, vpp),
                        batch, tps, _FUSED_FP8_TE_LOSS, _BRIDGE_ASSUMED, gather_bytes=1, tp_overlap=tp > 1)


BRIDGE_RUNS = (
    _bridge("h100", "llama3-8b", 8, 128, 1, 3, 1, 1, 1, 1, 14451),
    _bridge("h100", "llama3-70b", 64, 128, 1, 1, 4, 8, 1, 5, 1602),
    _bridge("h100", "llama3-405b", 1024, 512, 1, 1, 8, 8, 2, 8, 292),
    _bridge("b200", "llama3-8b", 8, 128, 2, 1, 1, 1, 1, 1, 30624),
    _bridge("b200", "llama3-405b", 128, 64, 1, 1, 4, 8, 2, 8, 661),
)

RUNS: tuple[PublishedRun, ...] = (BIGSCIENCE_RUNS + NARAYANAN_RUNS + KORTHIKANTI_RUNS + V100_RUNS + MEGATRON_LM_RUNS
                                  + NEMO_RUNS + BRIDGE_RUNS)
