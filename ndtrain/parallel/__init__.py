"""Parallel strategies, one file each; every collective goes through `ParallelContext.comm`."""

from ndtrain.parallel.ddp import DataParallel

__all__ = ["DataParallel"]
