"""How the `Trainer` drives each kind of engine, so that its loop is the only loop.

The loop drives every engine through one protocol, `TrainingEngine`: what the `Trainer` (and the
timeline recorder it hands the engine to) calls, nothing of how the engine trains. A kind
(`EngineKind`, generic in the engine it builds) says which ranks read the data, builds the engine
from the run's model, optimizer and LR schedule, and what the start-up lines, the step records and
the summary add, reading its own engine's figures. `engine_kind(cfg, ctx)` picks one from `KINDS`
(a new kind is a class and one entry there):
- "data-parallel": `Engine` (DDP, ZeRO, tp/pp/cp, single-process replicas), the dp axis reads the data;
- "parameter-server": `PSEngine` (`ps.servers` > 0), the workers read the data and the servers none.
`lockstep`: every rank runs each step with the others, so the loop may evaluate mid-run (async and
ssp workers are at different steps: they evaluate at the end only). `checkpoints`: the engine saves
and resumes, so the loop catches SIGTERM/SIGINT, agrees on them each step and checkpoints; without
(the parameter server) the signals end the processes as usual and nothing is written.
Nothing here communicates; `summary` is collective where the engine's is (the parameter server's).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ContextManager, Generic, Iterable, Protocol, Sequence, TypeVar

import torch
from torch import nn

from ndtrain.config import TrainConfig
from ndtrain.engine import Batch, Engine, StepResult
from ndtrain.eval.token_metrics import Evaluation
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.pipeline import Timeline
from ndtrain.ps.messages import LossFn, OptimizerFn
from ndtrain.ps.engine import PSEngine, check_ps_config
from ndtrain.run.preemption import StopRequest

LrLambda = Callable[[int], float]


class TrainingEngine(Protocol):
    """What the `Trainer` asks of an engine (`Engine`, `PSEngine`): steps, evaluation, checkpoints
    and the figures of its start-up line and summary."""

    model: nn.Module            # this rank's model (its class names a user's model in the logs)
    parameter_count: int        # Ψ of the whole model
    trainable_count: int        # of which require grad (Ψ less a LoRA run's frozen base)
    timeline: Timeline | None   # set by the timeline recorder to record a step's pipeline actions

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (collective)."""
        ...

    def evaluate(self, batches: Iterable[Batch]) -> Evaluation:
        """Mean loss, token count and next-token accuracy over every rank's `batches` (collective)."""
        ...

    def save(self, path: str | Path, *, keep: int = 2, progress: dict[str, Any] | None = None,
             step: int | None = None) -> Path:
        """Write a checkpoint into the folder `path` (collective; `UserError` where not supported)."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore the newest checkpoint of `path`, return its progress (collective; `UserError` where
        not supported)."""
        ...

    @property
    def skipped_steps(self) -> int:
        """Steps not applied because of a non-finite loss or gradient."""
        ...

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        ...


EngineT = TypeVar("EngineT", bound=TrainingEngine)


class EngineKind(ABC, Generic[EngineT]):
    """A kind of engine the loop drives: the figures it adds read the engine it built (`EngineT`)."""

    lockstep = True
    checkpoints = True
    title = "ndtrain: summary"

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    @abstractmethod
    def data_ranks(self) -> tuple[int, int]:
        """How many ranks share the data and this rank's place among them."""

    @abstractmethod
    def reads_data(self) -> bool:
        """Whether this rank's steps train on batches (the loop loads none for a rank that does not)."""

    @abstractmethod
    def build(self, model_fn: Callable[[], nn.Module], optimizer_fn: OptimizerFn, lr_lambda: LrLambda,
              loss_fn: LossFn | None) -> EngineT:
        """The engine of this rank, from the run's model, optimizer, LR schedule and loss."""

    @abstractmethod
    def stop_request(self) -> ContextManager[StopRequest]:
        """What the loop's SIGTERM/SIGINT handling is for this kind."""

    @abstractmethod
    def layout(self) -> str:
        """The layout, for the start-up line."""

    @abstractmethod
    def data_split(self) -> str:
        """Who shares the global batch, for the start-up line."""

    def step_record(self, engine: EngineT) -> dict[str, Any]:
        """Fields the step's metrics record adds."""
        return {}

    def summary(self, engine: EngineT) -> dict[str, Any]:
        """Fields the summary adds or replaces (collective: every rank calls it once, at the end)."""
        return {}

    def summary_rows(self, summary: dict[str, Any]) -> list[tuple[str, str]]:
        return []


class DataParallelKind(EngineKind[Engine]):
    """The data-parallel `Engine`: every rank trains every step together with the others."""

    def data_ranks(self) -> tuple[int, int]:
        return self.ctx.size("dp"), self.ctx.coord("dp")

    def reads_data(self) -> bool:
        return True

    def build(self, model_fn: Callable[[], nn.Module], optimizer_fn: OptimizerFn, lr_lambda: LrLambda,
              loss_fn: LossFn | None) -> Engine:
        return Engine(
            model_fn, optimizer_fn, self.ctx, self.cfg.parallel,
            scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
            grad_clip=self.cfg.optim.grad_clip, skip_nonfinite=self.cfg.optim.skip_nonfinite, loss_fn=loss_fn,
        )

    def stop_request(self) -> ContextManager[StopRequest]:
        return StopRequest()

    def layout(self) -> str:
        return " × ".join(f"{a}={self.ctx.size(a)}" for a in ("dp", "cp", "pp", "tp"))

    def data_split(self) -> str:
        return f"dp {self.ctx.size('dp')}"


class ParameterServerKind(EngineKind[PSEngine]):
    """`PSEngine`: W workers read the data and push/pull, the S servers serve (see ps/engine.py)."""

    checkpoints = False
    title = "ndtrain: summary (parameter server)"

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext) -> None:
        super().__init__(cfg, ctx)
        self.workers = check_ps_config(cfg, ctx.world_size)
        self.lockstep = cfg.ps.mode == "sync"

    def data_ranks(self) -> tuple[int, int]:
        """W workers share the data; servers read none (they get place 0 to build the same sampler)."""
        return self.workers, self.ctx.rank if self.reads_data() else 0

    def reads_data(self) -> bool:
        return self.ctx.rank < self.workers  # ranks 0..W-1 are the workers

    def build(self, model_fn: Callable[[], nn.Module], optimizer_fn: OptimizerFn, lr_lambda: LrLambda,
              loss_fn: LossFn | None) -> PSEngine:
        return PSEngine(model_fn, optimizer_fn, self.ctx, self.cfg, lr_lambda=lr_lambda, loss_fn=loss_fn)

    def stop_request(self) -> ContextManager[StopRequest]:
        return contextlib.nullcontext(StopRequest())  # no handlers: a signal ends the process

    def layout(self) -> str:
        ps = self.cfg.ps
        bound = f" (staleness ≤ {ps.staleness})" if ps.mode == "ssp" else ""
        return (f"parameter server {ps.mode}{bound}: {self.workers} worker(s) (ranks 0..{self.workers - 1}) + "
                f"{ps.servers} server(s)")

    def data_split(self) -> str:
        return f"{self.workers} workers"

    def step_record(self, engine: PSEngine) -> dict[str, Any]:
        return engine.worker_figures()

    def summary(self, engine: PSEngine) -> dict[str, Any]:
        return engine.summary()

    def summary_rows(self, summary: dict[str, Any]) -> list[tuple[str, str]]:
        ps = summary["ps"]
        return [
            ("pushes/s per worker", ", ".join(f"{p:.2f}" for p in ps["pushes_per_s"])),
            ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in ps["staleness_histogram"].items())
             + " (updates between a gradient's pull and its application: count)"),
            ("max clock lead", f"{ps['max_clock_lead']} step(s) ahead of the slowest worker"),
        ]


KINDS: dict[str, type[EngineKind[Any]]] = {"data-parallel": DataParallelKind, "parameter-server": ParameterServerKind}


def engine_kind(cfg: TrainConfig, ctx: ParallelContext) -> EngineKind[Any]:
    """The kind of engine the config asks for: the parameter server when `ps.servers` > 0."""
    return KINDS["parameter-server" if cfg.ps.servers else "data-parallel"](cfg, ctx)
