"""Parallel strategies, one file each, in one room per kind: data/ (the data-parallel interface, its
registry and every data-parallel strategy), model/ (tensor, vocab, context parallel, recompute),
pipeline/ (schedules as data and their runner). At this level, what the rooms share: model_spec.py
(what a model tells the strategies), placement.py (each parameter's place in the unsharded model),
grad_norm.py, precision.py, counting.py, and compose.py (model parallelism in its fixed order).
Every collective goes through `ParallelContext.comm` (dist/). Imports `dist`, `config` and `errors`;
never a model, a checkpoint, the engine or a run (tests/test_import_graph.py)."""

from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.single_process import SingleProcessDataParallel

__all__ = ["DistributedDataParallel", "SingleProcessDataParallel"]
