"""ndtrain: one PyTorch model trained across many processes with parallel strategies of our own.

Public surface:
    parallel = ndtrain.ParallelConfig(dp=2, zero=1)
    ctx = ndtrain.init(parallel)                          # joins torchrun's world, builds groups (topology)
    engine = ndtrain.Engine(model_fn, optimizer_fn, ctx, parallel)   # strategy options from `parallel`
    result = engine.train_step(micro_batches)
    engine.save(path); engine.load(path)
    ndtrain.Trainer(cfg, model_fn=..., loss_fn=...).run()   # data, eval, schedule, metrics, checkpoints
"""

from ndtrain.config import ParallelConfig, TrainConfig
from ndtrain.engine import Engine, StepResult
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.run.config_checks import resolve_config as load_config
from ndtrain.trainer import Trainer
from ndtrain.version import package_version

__version__ = package_version()

__all__ = ["Engine", "ParallelConfig", "ParallelContext", "StepResult", "TrainConfig", "Trainer", "UserError", "init",
           "load_config"]
