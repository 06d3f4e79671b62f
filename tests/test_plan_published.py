"""The published runs the planner is checked against (pure arithmetic): what each row states, the
software stack it ran, and the orderings its source measured. The leave-one-source-out and held-out
errors are tests/test_plan_loso.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import GPU_EFFICIENCY, GPU_TILE, GpuEfficiency
from ndtrain.plan.kernels import FUSED_FP8, PROFILES
from ndtrain.plan.published import ORDERINGS, RUNS, SOURCES, by_name, fit_runs, held_out_runs
from ndtrain.plan.published_megatron import NARAYANAN_RUNS
from ndtrain.plan.published_run import megatron_tokens
from ndtrain.plan.report import ordering_pairs


def test_at_least_8_fit_sources_on_3_gpu_generations_and_a_held_out_source() -> None:
    fit_sources = {run.source for run in fit_runs()}
    assert len(fit_sources) >= 8 and len(SOURCES) > len(fit_sources)
    assert {run.generation for run in fit_runs()} >= {"Volta", "Ampere", "Hopper"}
    assert held_out_runs() and not any(run.source.held_out for run in fit_runs())
    assert len(RUNS) == len(fit_runs()) + len(held_out_runs())


def test_every_row_cites_its_source_and_states_its_stack() -> None:
    for source in SOURCES:
        assert source.title and source.where and source.stack
    for run in RUNS:
        assert run.where and run.reported > 0, run.name
        base = next(name for name in sorted(PROFILES, key=len, reverse=True) if run.kernels.name.startswith(name))
        assert f"profile {base}" in run.source.stack, (run.source.key, run.kernels.name)


def test_reductions_and_gathers_are_what_the_runs_set() -> None:
    """Composer's MP Mode DEFAULT (reduce_dtype fp32) and torchtitan reduce fp32; llm-foundry's two PURE
    rows bf16; torchtitan's H200 run and Megatron-Bridge's FP8-CS recipe (fp8_param_gather) gather FP8
    parameters. Each changes only data-parallel time."""
    pure = {"A100 MPT-70b 64 GPUs", "A100 MPT-70b 32 GPUs"}
    for run in RUNS:
        fp32 = run.source.key.startswith("torchtitan") or (run.source.key == "llm-foundry" and run.name not in pure)
        assert run.grad_reduce_bytes == (4 if fp32 else 2), run.name
        assert run.gather_bytes == (1 if run.source.key in ("torchtitan H200", "Megatron-Bridge 25.11") else 2), run.name
        if run.gather_bytes == 1:
            bf16 = replace(run, gather_bytes=2)
            assert run.timing().dp_comm < bf16.timing().dp_comm and run.timing().compute == bf16.timing().compute
        if fp32:
            bf16 = replace(run, grad_reduce_bytes=2)
            assert run.timing().dp_comm > bf16.timing().dp_comm and run.timing().compute == bf16.timing().compute


def test_a_reported_tflops_is_read_with_megatrons_own_count() -> None:
    """Megatron counts 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) FLOPs per batch (Narayanan 2021 §5.1),
    attention over the full s×s matrix whatever the kernel."""
    l, h, s, v = 30, 4096, 4096, 131072
    spec = ModelSpec("g", "gpt", l, h, 32, 32, 4 * h, v, s, flash=True)
    per_token = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert megatron_tokens(spec, 465.9) == pytest.approx(465.9e12 / per_token)


def test_narayanan_2021s_tflops_are_read_with_its_own_count_which_includes_the_recompute() -> None:
    """Narayanan 2021 eq. (3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per batch, the forward of every
    layer counted a second time (activation recomputation), the logits' not."""
    for run in NARAYANAN_RUNS:
        m = run.model
        per_token = 96 * m.layers * m.hidden**2 * (1 + m.seq / (6 * m.hidden) + m.vocab / (16 * m.layers * m.hidden))
        tflops = float(run.where.split()[0])
        assert run.reported == pytest.approx(tflops * 1e12 / per_token)
        assert run.layout.pp == 1 and run.layout.recompute == "full"  # Table 1's pp = 1 rows


def test_data_parallel_reduction_overlaps_the_backward_only_where_the_runs_code_does() -> None:
    """Megatron-LM's local DDP of 2021-22 all-reduces after forward_backward_func returns, DeepSpeed's
    pipeline engine at the end of the batch (ReduceGrads): exposed. FSDP, FSDP2 and Megatron-Core with
    --overlap-grad-reduce run it behind the backward. Only data-parallel time changes."""
    exposed = {"BigScience", "Narayanan 2021", "Korthikanti 2022"}
    for run in RUNS:
        assert run.dp_overlap == (run.source.key not in exposed), run.name
        if not run.dp_overlap and run.layout.dp > 1:
            overlapped = replace(run, dp_overlap=True)
            assert run.timing().dp_comm > overlapped.timing().dp_comm
            assert run.timing().compute == overlapped.timing().compute


def test_tensor_parallel_communication_overlaps_the_gemms_only_where_the_runs_state_it() -> None:
    """Megatron-LM's README states --tp-comm-overlap; Megatron-Bridge's Llama 3 70B and 3.1 405B recipes
    set CommOverlapConfig(tp_comm_overlap=True) (userbuffers). NeMo 24.07 states nothing, so it is costed
    exposed; Bridge's 8B recipe sets it only when tp > 1. Only tensor-parallel time changes."""
    for run in RUNS:
        bridge = run.source.key == "Megatron-Bridge 25.11" and run.layout.tp > 1
        assert run.tp_overlap == (run.source.key == "Megatron-LM 2024" or bridge), run.name
        if run.tp_overlap and run.layout.tp > 1:
            exposed = replace(run, tp_overlap=False)
            assert run.timing().tp_comm < exposed.timing().tp_comm
            assert run.timing().compute == exposed.timing().compute


def test_megatron_bridge_runs_transformer_engines_fused_cross_entropy() -> None:
    """Bridge's recipes set cross_entropy_fusion_impl = "te": the fused-fp8 profile with 6 bytes per logit
    (TE's Triton kernel) instead of Megatron's 38: the last stage's compute is shorter."""
    for run in RUNS:
        if run.source.key != "Megatron-Bridge 25.11":
            assert run.kernels.loss != 6, run.name
            continue
        assert replace(run.kernels, name=FUSED_FP8.name, loss=FUSED_FP8.loss) == FUSED_FP8 and run.kernels.loss == 6
        assert run.timing().compute < replace(run, kernels=FUSED_FP8).timing().compute


def test_torchtitans_selective_op_checkpointing_recomputes_half_the_matmuls() -> None:
    none = by_name("torchtitan A100", "llama2-13b mbs2 none")
    op = by_name("torchtitan A100", "llama2-13b mbs2 selective op")
    full = replace(op, layout=replace(op.layout, recompute="full"))
    assert none.predicted() > op.predicted() > full.predicted()
    assert none.reported > op.reported  # 2162 vs 1904 WPS: the recompute is not free


def misses(efficiency: GpuEfficiency | None = None) -> set[tuple[str, str]]:
    return {(faster.name, slower.name) for _, runs in ORDERINGS
            for faster, slower, ok in ordering_pairs(runs, efficiency) if not ok}


def test_compared_layouts_are_ordered_as_measured_but_one() -> None:
    """Every compared pair keeps its measured order except BigScience's tp2 pp24 over tp4 pp24 (9.3 %
    apart measured; the model puts tp4 3.9 % ahead: its halved bubble and data-parallel volume outweigh
    its tp traffic, once DeepSpeed's sends are costed partitioned over tp as its engine sends them)."""
    assert misses() == {("181B trial tp2 pp24 dp8 mbs1", "181B trial tp4 pp24 dp4 mbs1")}


def test_wave_quantization_would_move_the_tp2_against_tp4_pipeline_gap_toward_the_measured_one() -> None:
    """tp4 pp24 runs 2048-token GEMMs of 672 tiles: 7 waves on 108 SMs, the last 22 % full; tp2's 1344
    tiles fill 13 waves to 96 %. Measured, tp4 is 9.3 % slower (130.60 against 119.53 s). The planner's
    constants (no wave term: it raised the leave-one-source-out error) predict tp4 3.9 % faster, the
    same constants with 128 × 256 tiles 2.2 % faster: toward the measured gap, short of its sign (the
    one ordering the model misses either way)."""
    tp2, tp4 = by_name("BigScience", "181B trial tp2 pp24 dp8 mbs1"), by_name("BigScience", "181B trial tp4 pp24 dp4 mbs1")
    assert GPU_EFFICIENCY.tile is None
    waves = replace(GPU_EFFICIENCY, tile=GPU_TILE)
    assert tp4.reported / tp2.reported == pytest.approx(119.53 / 130.60)  # tokens/s: tp4 is the slower
    gap, gap_waves = (tp4.timing(eff).step / tp2.timing(eff).step - 1 for eff in (GPU_EFFICIENCY, waves))
    assert (round(100 * gap, 1), round(100 * gap_waves, 1)) == (-3.9, -2.2)
