"""Parallel strategies, one file each; every collective goes through `ParallelContext.comm`."""

from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.single_process import SingleProcessDataParallel

__all__ = ["DistributedDataParallel", "SingleProcessDataParallel"]
