"""Data-parallel strategies: the one interface the engine, the checkpoints and the pipeline runner
drive every strategy through, and the registry of strategies (strategy.py); what a rank's optimizer
holds of each parameter, for checkpoints (held_slices.py); parameter groups (param_groups.py); the
bucket layer and flat layout they share (buckets.py, host_buckets.py, flat_layout.py, sync_switch.py);
ZeRO-0 (replicated.py: DDP, ddp.py and flat_adamw.py, or unsharded fp32 masters), ZeRO-1/2
(zero1_gradients.py, zero1_optimizer.py, zero_strategy.py, zero2_gradients.py), ZeRO-3 / FSDP
(zero3_wrap.py, zero3_unit.py, zero3_split_passes.py, zero3_parameters.py, zero3_strategy.py), an
interleaved pipeline's chunks each in its own wrapper (chunks.py) and single-process replicas
(single_process.py). Each strategy file answers for itself; no file looks at another strategy's type
or private fields (tests/test_strategy_privacy.py). Imports `dist`, `config` and `parallel`'s shared
modules (placement, precision, grad_norm, model_spec, model.tensor) and the pipeline's `StageHooks`;
never a model."""
