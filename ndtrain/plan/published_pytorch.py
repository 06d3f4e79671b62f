"""Published runs of PyTorch-native stacks: MosaicML llm-foundry (MPT) and torchtitan.

Each source's stack, read in its code at the commit its numbers were measured with:
    llm-foundry  MPT (llmfoundry/models/mpt): LayerNorm through F.layer_norm (LPLayerNorm), nn.GELU, Triton
                 flash attention, no dropout in the benchmark yamls, FSDP FULL_SHARD by Composer 0.16;
                 the kernel profile `eager` (its LayerNorm and GeLU are single native kernels)
    torchtitan   Llama (torchtitan/models/llama/model.py @ 0413364): RoPE by complex multiplication in
    (A100)       fp32, SwiGLU as silu(w1 x)·w3 x, SDPA attention; RMSNorm `fused_rmsnorm` (a Triton kernel,
                 torchtitan/models/norms.py) for the 8B and 13B configs, the PyTorch-written `rmsnorm`
                 for the 70B ones (train_configs/*.toml @ 0413364); torch.compile off: `eager`, with the
                 8B/13B rows' RMSNorm at a fused kernel's 4 bytes per element
    torchtitan   Trainy on WhiteFiber H200 (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md):
    (H200)       `--training.compile --model.converters=float8` with FP8 all-gather of FSDP parameters
                 (`--float8.enable_fsdp_float8_all_gather`): `compiled-fp8`, parameters gathered in 1 byte
Gradient reduction: Composer's FSDP "MP Mode" DEFAULT reduces in fp32 and PURE in bf16
(composer/trainer/mosaic_fsdp_utils.py `get_mixed_precision` @ v0.16.4, which llm-foundry's setup.py
pinned); torchtitan's FSDP2 policy reduces in fp32 (`mixed_precision_reduce = "float32"`).
"""

from __future__ import annotations

from dataclasses import replace

from ndtrain.plan.arch import PRESETS, ModelSpec
from ndtrain.plan.kernels import COMPILED_FP8, EAGER
from ndtrain.plan.published_run import PublishedRun, Source, fsdp

# --- mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 061f2c7 -----------------------
# MPT: GeLU MLP 4h, tied embedding, learned positions (NumParams grows with SeqLen), vocab 50368,
# attn_impl flash (scripts/train/yamls/pretrain/mpt-*.yaml @ 8c8dd48; submit_benchmarks.py at b2a43a1
# runs its default `triton`). Rows: SeqLen 2048, MPT 7b and larger, bf16, FULL_SHARD; Activation
# Checkpointing True → full.
LLM_FOUNDRY = Source(
    "llm-foundry", "MosaicML llm-foundry MPT training benchmarks",
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md@061f2c7, tables 'H100 80GB BF16' and "
    "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'",
    "Composer 0.16 FSDP, PyTorch 2.1 eager, Triton flash attention (profile eager)")


def _mpt_spec(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, heads, 4 * hidden, 50368, 2048, flash=True, dropout=False)


_MPT = {"7b": _mpt_spec("mpt-7b", 32, 4096, 32), "13b": _mpt_spec("mpt-13b", 40, 5120, 40),
        "30b": _mpt_spec("mpt-30b", 48, 7168, 56), "70b": _mpt_spec("mpt-70b", 80, 8192, 64)}
_H100, _A100 = "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
_ROCE = 200 / 8  # 1600 Gb/s per node of 8 GPUs = 25 GB/s per GPU
_COMPOSER_REDUCE_BYTES = {"DEFAULT": 4, "PURE": 2}


def _mpt(table: str, gpu_name: str, size: str, gpus: int, mbs: int, batch: int, ac: bool, tps: float,
         inter_bw_gbs: float | None = None, mp_mode: str = "DEFAULT") -> PublishedRun:
    return PublishedRun(LLM_FOUNDRY, f"{'H100' if gpu_name == 'h100-sxm' else 'A100'} MPT-{size} {gpus} GPUs",
                        f"table '{table}': {tps} T/s/GPU", _MPT[size], gpu_name,
                        fsdp(gpus, mbs, "full" if ac else "none"), batch, tps, EAGER,
                        "H100 inter-node link: the planner's default per GPU", inter_bw_gbs,
                        _COMPOSER_REDUCE_BYTES[mp_mode])


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
# checkpointing (torchtitan/parallelisms/parallelize_llama.py @ 0413364, `_get_custom_policy`) saves
# the outputs of `no_recompute_list` but every second mm's: recompute "op" (`gpu_compute.py`).
TITAN_A100 = Source(
    "torchtitan A100", "torchtitan performance numbers, FSDP2 on 64 A100 80GB",
    "pytorch/torchtitan docs/performance.md@0413364, tables 'LLaMa 3 performance numbers' and 'LLaMa 2 "
    "performance numbers'",
    "PyTorch eager (torch.compile off), SDPA flash attention, FSDP2; fused Triton RMSNorm for 8B/13B (profile eager)")
_FUSED_NORM = replace(EAGER, name="eager (fused RMSNorm)", rms_norm=4)


def _titan(table: str, name: str, mbs: int, recompute: str, wps: float) -> PublishedRun:
    kernels = EAGER if name.endswith("70b") else _FUSED_NORM
    label = "selective op" if recompute == "op" else recompute
    return PublishedRun(TITAN_A100, f"{name} mbs{mbs} {label}", f"table '{table}': {wps} WPS", PRESETS[name],
                        "a100-80gb", fsdp(64, mbs, recompute), 64 * mbs, wps, kernels,
                        "inter-node link: the planner's default per GPU", grad_reduce_bytes=4)


TITAN_A100_RUNS = (
    _titan("LLaMa 3 performance numbers", "llama3-8b", 1, "op", 2973),
    _titan("LLaMa 3 performance numbers", "llama3-70b", 1, "full", 331),
    _titan("LLaMa 2 performance numbers", "llama2-13b", 2, "none", 2162),
    _titan("LLaMa 2 performance numbers", "llama2-13b", 2, "op", 1904),
    _titan("LLaMa 2 performance numbers", "llama2-70b", 1, "op", 355),
    _titan("LLaMa 2 performance numbers", "llama2-70b", 2, "full", 353),
)

# --- pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @ cbccb38 -------
# Llama 3.1 8B (llama3-8b's shapes), 4 and 8 nodes of 8 H200, 400 Gb/s per GPU; local batch 2;
# torchtitan/models/llama3/train_configs/llama3_8b.toml @ e7c0cae: seq_len 8192, selective op AC ("op"),
# FSDP over every GPU (data_parallel_shard_degree = -1). TPS/GPU at the 100th iteration.
TITAN_H200 = Source(
    "torchtitan H200", "torchtitan benchmark: Llama 3.1 8B on H200 (Trainy, WhiteFiber, June 2025)",
    "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md@cbccb38, table 'Results'",
    "torch.compile + torchao Float8 (tensorwise), FP8 all-gather of FSDP2 parameters (profile compiled-fp8)")


def _h200(nodes: int, tps: float) -> PublishedRun:
    gpus = 8 * nodes
    return PublishedRun(TITAN_H200, f"llama3-8b {gpus} GPUs", f"NUM_NODES {nodes}: {tps} TPS/GPU", PRESETS["llama3-8b"],
                        "h200", fsdp(gpus, 2, "op"), 2 * gpus, tps, COMPILED_FP8, grad_reduce_bytes=4,
                        gather_bytes=1)


TITAN_H200_RUNS = (_h200(4, 10938), _h200(8, 10753))

RUNS: tuple[PublishedRun, ...] = FOUNDRY_RUNS + TITAN_A100_RUNS + TITAN_H200_RUNS
