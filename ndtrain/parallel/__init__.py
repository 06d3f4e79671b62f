"""Parallel strategies, one file each; every collective goes through `ParallelContext.comm`."""

from ndtrain.parallel.ddp import DataParallel
from ndtrain.parallel.replicate import SingleProcessDataParallel

__all__ = ["DataParallel", "SingleProcessDataParallel"]
