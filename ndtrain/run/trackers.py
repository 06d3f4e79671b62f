"""Experiment trackers for `log.report_to`: TensorBoard, Weights & Biases (offline), MLflow (local).

Rank 0 only. Each tracker gets what metrics.jsonl gets, every numeric field of a record (bool as
0/1) as a scalar at the record's `step`, and the resolved config flattened to `section.key` as
hyperparameters. Everything stays in the run directory; nothing reaches the network:

  tensorboard  RUN_DIR/tensorboard: event files (torch.utils.tensorboard), values stored as float32
  wandb        RUN_DIR/wandb/offline-run-*: mode "offline" (`wandb sync` uploads it later); no git,
               code, console, system-metric or requirements capture; error reports to W&B off
  mlflow       RUN_DIR/mlflow.db (SQLite tracking store; MLflow 3 refuses its file store unless an
               environment variable allows it), artifacts in RUN_DIR/mlflow-artifacts; telemetry off

W&B and MLflow switch their own telemetry/error reporting off only through environment variables
(WANDB_ERROR_REPORTING, MLFLOW_DISABLE_TELEMETRY): the trackers set them in this process before
starting the library; they change nothing in ndtrain.

Resume (a run continued from the checkpoint at step s): TensorBoard writes with purge_step s+1, so
readers drop events past s from the interrupted start; W&B and MLflow continue the run whose id
RUN_DIR/trackers.json holds (W&B: same id, resume="allow", a new offline folder per start; MLflow:
the same run, reopened). Neither can delete logged points, so values logged past s before the
interruption stay there beside the new ones. A run started from step 0 begins new W&B and MLflow
runs (and TensorBoard purges everything from step 1).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ndtrain.errors import UserError

PROJECT = "ndtrain"
# tracker name -> the module it needs (the pip extra is named after the tracker)
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "trackers.json"


def check_trackers(names: list[str]) -> None:
    """Every name of `log.report_to` must be a known tracker whose library is installed."""
    for name in names:
        if name not in TRACKER_MODULES:
            raise UserError(f"log.report_to names {name!r}: choose from {', '.join(TRACKER_MODULES)}")
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            raise UserError(
                f"log.report_to includes {name!r} but {TRACKER_MODULES[name]} is not installed: "
                f"pip install 'ndtrain[{name}]' (or 'ndtrain[tracking]' for all trackers)"
            )
    if len(set(names)) != len(names):
        raise UserError(f"log.report_to={names!r} names a tracker twice: list each once")


def flat_config(config: Any) -> dict[str, Any]:
    """A (dataclass) config as {"section.key": value}, None values left out as in config.toml."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        elif value is not None:
            flat[prefix[:-1]] = value

    walk("", dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config)
    return flat


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics record except its step."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def _as_text(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


class Tracker(Protocol):
    name: str

    def start(self, config: dict[str, Any]) -> None: ...

    def log(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any] | None, status: str) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self.log_dir = run_dir / "tensorboard"
        self.purge_step = resume_step + 1

    def start(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(self.log_dir), purge_step=self.purge_step)
        values = {k: v if isinstance(v, (bool, int, float, str)) else _as_text(v) for k, v in config.items()}
        experiment, session_start, self.session_end = hparams(values, dict.fromkeys(["loss", "val_loss"]))
        for summary in (experiment, session_start):
            self.writer.file_writer.add_summary(summary)

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, summary: dict[str, Any] | None, status: str) -> None:
        if summary is not None:
            self.writer.file_writer.add_summary(self.session_end)
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, run_id: str | None) -> None:
        self.run_dir = run_dir
        self.run_id = run_id

    def start(self, config: dict[str, Any]) -> None:
        os.environ["WANDB_ERROR_REPORTING"] = "false"  # W&B's only switch for its error reports
        import wandb

        settings = wandb.Settings(
            mode="offline", silent=True, console="off", disable_git=True, save_code=False,
            disable_job_creation=True, x_disable_stats=True, x_disable_meta=True,
            x_disable_machine_info=True, x_save_requirements=False,
        )
        self.run = wandb.init(
            project=PROJECT, name=self.run_dir.name, id=self.run_id, resume="allow" if self.run_id else None,
            dir=str(self.run_dir), config=config, settings=settings,
        )
        self.run_id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any] | None, status: str) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=0 if status == "finished" else 1)


class MlflowTracker:
    name = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
    BATCH = 100  # MLflow takes at most 100 params per log_batch

    def __init__(self, run_dir: Path, run_id: str | None) -> None:
        self.run_dir = run_dir.resolve()
        self.run_id = run_id

    def start(self, config: dict[str, Any]) -> None:
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # MLflow's only switch for its telemetry
        import mlflow.telemetry
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        mlflow.telemetry.set_telemetry_client()  # drops a client made by an earlier import of mlflow
        store_logger = logging.getLogger("mlflow.store")  # "Creating initial MLflow database tables..."
        level = store_logger.level
        store_logger.setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():  # SQLAlchemy deprecations inside MLflow's store
                warnings.simplefilter("ignore", DeprecationWarning)
                self.client = MlflowClient(tracking_uri=f"sqlite:///{self.run_dir / 'mlflow.db'}")
            experiment = self.client.get_experiment_by_name(PROJECT)
        finally:
            store_logger.setLevel(level)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            PROJECT, artifact_location=(self.run_dir / "mlflow-artifacts").as_uri()
        )
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
            logged: dict[str, str] = {}
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
        # MLflow forbids changing a param: a resumed run keeps its first values (config.toml has the current ones)
        params = [Param(k, _as_text(v)) for k, v in config.items() if k not in logged]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self.BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, summary: dict[str, Any] | None, status: str) -> None:
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, self.STATUS[status])


class Trackers:
    """The trackers of one run (none when `names` is empty: every rank but 0, or no report_to).

    Use as a context manager around the run, `start` once the resumed step is known, `log` each
    metrics record (a MetricsLog sink), `finish` with the summary; leaving the context without
    `finish` (an exception, a preemption) closes the trackers with status failed or killed.
    """

    def __init__(self, names: list[str], run_dir: Path) -> None:
        self.names = list(names)
        self.run_dir = run_dir
        self.active: list[Tracker] = []

    def start(self, config: dict[str, Any], resume_step: int) -> None:
        if not self.names:
            return
        ids_path = self.run_dir / IDS_FILE
        ids = json.loads(ids_path.read_text()) if resume_step and ids_path.exists() else {}
        makers = {
            "tensorboard": lambda: TensorBoardTracker(self.run_dir, resume_step),
            "wandb": lambda: WandbTracker(self.run_dir, ids.get("wandb")),
            "mlflow": lambda: MlflowTracker(self.run_dir, ids.get("mlflow")),
        }
        for name in self.names:
            tracker = makers[name]()
            tracker.start(config)
            self.active.append(tracker)
        ids.update({t.name: t.run_id for t in self.active if getattr(t, "run_id", None)})
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, record: dict[str, Any]) -> None:
        if self.active and "step" in record:
            values = scalars(record)
            for tracker in self.active:
                tracker.log(values, int(record["step"]))

    def finish(self, summary: dict[str, Any] | None = None, status: str = "finished") -> None:
        active, self.active = self.active, []
        for tracker in active:
            tracker.finish(summary, status)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        from ndtrain.run.preemption import Preempted

        if self.active:
            status = "finished" if error is None else "killed" if isinstance(error, (Preempted, KeyboardInterrupt)) else "failed"
            self.finish(None, status)
