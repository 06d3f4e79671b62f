"""Parallel strategies, one file each; every collective goes through `ParallelContext.comm`."""

from ndtrain.parallel.ddp import DistributedDataParallel
from ndtrain.parallel.single_process_dp import SingleProcessDataParallel

__all__ = ["DistributedDataParallel", "SingleProcessDataParallel"]
