"""Data-parallel strategies: the one interface the engine, the checkpoints and the pipeline runner
drive every strategy through, and its registry (strategy.py); the bucket layer and flat layout
they share (buckets.py, host_buckets.py, flat_layout.py); DDP (ddp.py, flat_adamw.py), ZeRO-1/2
(zero1_*.py, zero2_gradients.py), ZeRO-3 / FSDP (zero3_*.py) and single-process replicas
(single_process.py). Imports `dist`, `config` and `parallel`'s shared modules (placement,
precision, grad_norm, pipeline chunks); never a model."""
