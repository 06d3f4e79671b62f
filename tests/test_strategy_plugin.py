"""A data-parallel strategy of the test's own is one class plus one registration line, and the engine
trains, checkpoints and pipelines it without a change to any file of ndtrain.

`AllReduceStrategy` is a plain replicated strategy written here against the interface of
parallel/data/strategy.py: the bare module, every parameter's gradient all-reduced through
`ctx.comm` (mean over dp_cp) as soon as backward has accumulated it, unless inside `no_sync`, and
the caller's AdamW over the whole model. It is registered in a table of the test's own,
`{**STRATEGIES, ("ddp", 0): AllReduceStrategy}`, handed to `Engine(strategies=...)`: nothing global
changes, so no other test sees it. Two spawns of 2 gloo processes:

- dp=2, 2 micro-batches a step, clipping: parity with the single-process reference; a checkpoint
  the toy writes loads under the built-in DDP (ZeRO-0) strategy, and one DDP writes loads under the
  toy, each continuing exactly as the writer does (AdamW's moments came back);
- pp=2 (1F1B, the runner handed the toy's `StageHooks`): parity with the reference, and the
  checkpoint it writes loads into a single-process DDP engine in the parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.engine import Engine
from ndtrain.parallel.data.held_slices import WholeParameters
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn, parameter_groups
from ndtrain.parallel.data.strategy import STRATEGIES
from ndtrain.parallel.grad_norm import GradPiece, optimizer_param_grads, whole_pieces
from ndtrain.parallel.pipeline.hooks import StageHooks
from tests.helpers.models import adamw, batch, make_llama, micro_batches
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import Reference, decay_groups, train_reference
from tests.helpers.runner import init_method, run_distributed

DTYPE = torch.float64  # the reference's and the runs' summation orders differ: float64 keeps that noise ~1e-14
STEPS = 3
ACCUMULATION = 2  # micro-batches per step: one backward under no_sync, one synchronising
MAX_NORM = 0.3  # below the tiny model's gradient norms: clipping is exercised
TOLERANCE = 1e-5


class AllReduceStrategy(WholeParameters):
    """A replicated `DataParallelStrategy` (see the module docstring). Building it broadcasts every
    parameter from dp_cp rank 0; each synchronising backward all-reduces every gradient, one call per
    parameter (2(N−1)/N of the gradient bytes per rank)."""

    grads_sharded = False
    sharded_model = None
    forward_communicates = False

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn,
                 group_fn: GroupFn) -> None:
        self.module = model
        self.chunks: list[nn.Module] = list(model) if isinstance(model, nn.ModuleList) else [model]
        self.stage_hooks = [StageHooks(no_sync=self.no_sync) for _ in self.chunks]
        self.optimizer = optimizer_fn(parameter_groups(model, group_fn))
        self.ctx, self.group = ctx, ctx.group("dp_cp")
        self.syncing = True
        self.deferred = 0  # backwards run under no_sync
        with torch.no_grad():
            for p in model.parameters():
                ctx.comm.broadcast(p, self.group, src=0)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        if self.syncing and param.grad is not None:
            self.ctx.comm.all_reduce(param.grad, self.group)
            param.grad.div_(self.group.size)

    @contextmanager
    def _deferred(self) -> Iterator[None]:
        self.syncing = False
        self.deferred += 1
        try:
            yield
        finally:
            self.syncing = True

    def no_sync(self) -> AbstractContextManager[None]:
        return self._deferred()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step_during_backward(self, allowed: bool) -> None:
        """Never: the step runs after the norm."""

    def optimizer_grads(self) -> list[torch.Tensor]:
        return optimizer_param_grads(self.optimizer)

    def grad_pieces(self) -> list[GradPiece]:
        return whole_pieces((p for g in self.optimizer.param_groups for p in g["params"]), self.ctx.group("tp").size)

    def state_bytes(self) -> dict[str, int]:
        return {"parameters": 0, "gradients": 0, "optimizer": 0}


TOY = {**STRATEGIES, ("ddp", 0): AllReduceStrategy}  # the one registration line


def make_engine(ctx: ParallelContext, parallel: ParallelConfig, toy: bool) -> Engine:
    return Engine(lambda: make_llama(DTYPE), adamw, ctx, parallel, grad_clip=MAX_NORM,
                  strategies=TOY if toy else STRATEGIES)


def params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


def reference(steps: int, pieces: int) -> Reference:
    model = make_llama(DTYPE)
    return train_reference(model, adamw(decay_groups(model)), (batch(step) for step in range(steps)),
                           pieces=pieces, clip=MAX_NORM)


# ------------------------------------------------------------------------------------ workers
def _data_parallel_worker(root: str) -> dict[str, Any]:
    """dp=2: the toy trains STEPS steps and saves; DDP loads it and goes on; the toy loads DDP's next one."""
    ctx = init(ParallelConfig(dp=2), init_method=init_method())
    parallel = ParallelConfig(dp=2)

    def step(engine: Engine, index: int) -> float:
        return engine.train_step(micro_batches(index, ctx.rank, 2, ACCUMULATION)).grad_norm

    toy = make_engine(ctx, parallel, toy=True)
    assert type(toy.dp) is AllReduceStrategy
    norms = [step(toy, i) for i in range(STEPS)]
    trained = params(toy)
    toy.save(f"{root}/toy")
    step(toy, STEPS)
    toy_next = params(toy)

    ddp = make_engine(ctx, parallel, toy=False)
    assert type(ddp.dp) is not AllReduceStrategy
    assert ddp.load(f"{root}/toy")["step"] == STEPS
    loaded_by_ddp = params(ddp)
    step(ddp, STEPS)
    ddp_next = params(ddp)
    ddp.save(f"{root}/ddp")
    step(ddp, STEPS + 1)

    toy_again = make_engine(ctx, parallel, toy=True)
    assert toy_again.load(f"{root}/ddp")["step"] == STEPS + 1
    loaded_by_toy = params(toy_again)
    step(toy_again, STEPS + 1)
    return {"norms": norms, "trained": trained, "loaded_by_ddp": loaded_by_ddp, "toy_next": toy_next,
            "ddp_next": ddp_next, "loaded_by_toy": loaded_by_toy, "ddp_after": params(ddp),
            "toy_after": params(toy_again)}


def _pipeline_worker(root: str) -> dict[str, Any]:
    """pp=2 under 1F1B: the toy's stage hooks drive the runner; the toy saves what it trained."""
    ctx = init(ParallelConfig(pp=2), init_method=init_method())
    engine = make_engine(ctx, ParallelConfig(pp=2, pp_schedule="1f1b"), toy=True)
    assert type(engine.dp) is AllReduceStrategy and len(engine.dp.stage_hooks) == 1
    norms = [engine.train_step(micro_batches(i, 0, 1, ACCUMULATION)).grad_norm for i in range(STEPS)]
    assert engine.dp.deferred == STEPS * (ACCUMULATION - 1)  # the runner ran every backward but the last under no_sync
    engine.save(f"{root}/pipeline")
    return {"norms": norms, "params": params(engine)}


# ------------------------------------------------------------------------------------ checks
@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_data_parallel_worker, 2, str(tmp_path_factory.mktemp("dp")), timeout=300)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pp")
    return root, run_distributed(_pipeline_worker, 2, str(root), timeout=300)


def test_the_registered_toy_trains_like_the_single_process_reference(data_parallel: list[dict[str, Any]]) -> None:
    ref = reference(STEPS, 2 * ACCUMULATION)
    assert max(ref.norms) > MAX_NORM
    for rank, run in enumerate(data_parallel):
        assert_params_close(run["trained"], ref.state, TOLERANCE, f"toy strategy rank {rank}")
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref.norms), rtol=TOLERANCE, atol=0)


def test_a_toy_checkpoint_loads_under_ddp_and_a_ddp_one_under_the_toy(data_parallel: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(data_parallel):
        for name, tensor in run["trained"].items():
            assert torch.equal(run["loaded_by_ddp"][name], tensor), f"rank {rank}: DDP loaded {name} changed"
        for name, tensor in run["ddp_next"].items():
            assert torch.equal(run["loaded_by_toy"][name], tensor), f"rank {rank}: the toy loaded {name} changed"
        # the next step after a load is the writer's next step: the optimizer state came back too
        assert_params_close(run["ddp_next"], run["toy_next"], 1e-12, f"DDP after the toy's checkpoint, rank {rank}")
        assert_params_close(run["toy_after"], run["ddp_after"], 1e-12, f"the toy after DDP's checkpoint, rank {rank}")
        moved = max((run["toy_after"][k] - run["loaded_by_toy"][k]).abs().max().item() for k in run["toy_after"])
        assert moved > 1e-6, "the step after the load changed nothing: the comparison above could not fail"


def test_the_toy_runs_under_a_two_stage_pipeline(pipeline: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = pipeline
    ref = reference(STEPS, ACCUMULATION)
    seen: set[str] = set()
    for rank, run in enumerate(results):
        assert_params_close(run["params"], {k: ref.state[k] for k in run["params"]}, TOLERANCE, f"pp stage {rank}")
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref.norms), rtol=TOLERANCE, atol=0)
        seen |= set(run["params"])
    assert seen == set(ref.state) and not set(results[0]["params"]) & set(results[1]["params"])
    single = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1), toy=False)
    assert single.load(root / "pipeline")["step"] == STEPS
    assert_params_close(params(single), ref.state, TOLERANCE, "the pipeline's checkpoint in one process")
