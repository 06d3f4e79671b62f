"""Trackers and run records: TensorBoard, W&B (offline) and MLflow hold exactly the values of
metrics.jsonl, read back with each library's own reader; timestamps, versions and git in the records."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.config import dump_toml
from ndtrain.run.config_checks import resolve_config
from ndtrain.errors import UserError
from ndtrain.run.metrics import MetricsLog
from ndtrain.run.info import SOURCE_DIR, git_revision
from ndtrain.run.trackers import Trackers
from tests.helpers.runs import TINY_4_STEPS as TINY, corpus_file, ndtrain

ALL = 'log.report_to=["tensorboard", "wandb", "mlflow"]'


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def series(run: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run) if key in r}


def float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def tensorboard_run(run: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return events


def tensorboard_hparams(events: Any) -> dict[str, Any]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def wandb_records(offline_run: Path) -> list[dict[str, Any]]:
    """The records of a .wandb transaction log, printed by W&B's own inspector (`wandb leet inspect`)."""
    env = {**os.environ, "WANDB_ERROR_REPORTING": "false"}
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def wandb_history(wandb_log: list[dict[str, Any]], key: str) -> dict[int, float]:
    rows = [r["history"] for r in wandb_log if r["type"] == "history"]
    return {int(h["step"]["num"]): h["item"][key] for h in rows if key in h["item"]}


def mlflow_client(run: Path) -> Any:
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():  # SQLAlchemy deprecations inside MLflow's store
        warnings.simplefilter("ignore", DeprecationWarning)
        return MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")


def test_trackers_hold_the_metrics_and_config_of_a_two_process_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ndtrain("train", "--nproc", "2", "--data", corpus_file(tmp_path), "--out", str(run), *TINY,
                   "--set", "log.eval_every=2", "--set", ALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlflow" not in proc.stderr.lower() and "wandb" not in proc.stderr.lower(), proc.stderr[-3000:]
    loss, val = series(run, "loss"), series(run, "val_loss")
    assert list(loss) == [1, 2, 3, 4] and list(val) == [2, 4]
    ids = json.loads((run / "trackers.json").read_text())

    events = tensorboard_run(run)  # TensorBoard keeps float32 values
    assert {e.step: e.value for e in events.Scalars("loss")} == {s: float32(v) for s, v in loss.items()}
    assert {e.step: e.value for e in events.Scalars("val_loss")} == {s: float32(v) for s, v in val.items()}
    assert [e.step for e in events.Scalars("epoch")] == [1, 2, 3, 4]
    hparams = tensorboard_hparams(events)
    assert hparams["model.dim"] == 32 and hparams["schedule.global_batch"] == 8
    assert hparams["log.report_to"] == "tensorboard, wandb, mlflow" and hparams["model.preset"] == "tiny"

    (offline_run,) = (run / "wandb").glob("offline-run-*")  # rank 1 started no run
    assert offline_run.name.endswith(ids["wandb"])
    wandb_log = wandb_records(offline_run)
    assert wandb_history(wandb_log, "loss") == loss and wandb_history(wandb_log, "val_loss") == val
    (header,) = [r["run"] for r in wandb_log if r["type"] == "run"]
    config = header["config"]["update"]
    assert config["model.dim"] == 32 and config["log.report_to"] == ["tensorboard", "wandb", "mlflow"]

    client = mlflow_client(run)
    (found,) = client.search_runs([client.get_experiment_by_name("ndtrain").experiment_id])
    assert found.info.run_id == ids["mlflow"] and found.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")} == loss
    assert {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "val_loss")} == val
    assert found.data.params["model.dim"] == "32" and found.data.params["parallel.dp"] == "0"

    summary = json.loads((run / "summary.json").read_text())
    assert summary["torch_version"] == torch.__version__ and summary["python_version"].count(".") == 2
    assert summary["started"] < summary["finished"] and summary["elapsed_s"] > 0 and summary["epoch"] > 0
    assert [r["epoch"] for r in records(run)] == pytest.approx([summary["epoch"] * s / 4 for s in (1, 2, 3, 4)])
    assert summary["step_time_median_s"] == statistics.median(r["step_time_s"] for r in records(run)[1:])


def test_trackers_continue_their_runs_on_resume(tmp_path: Path) -> None:
    """In process: a start logs steps 1-4 and stops; a resume from step 2 logs new values at 3 and 4."""
    config = {"model.dim": 32, "log.report_to": ["tensorboard", "wandb", "mlflow"]}
    first, second = {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, {3: 3.5, 4: 2.5}
    for start, values in ((0, first), (2, second)):
        trackers = Trackers(config["log.report_to"], tmp_path)
        with trackers:
            trackers.start(config, resume_step=start)
            for step, loss in values.items():
                trackers.log({"step": step, "loss": loss, "time": "not a number", "skipped": False})
            if start:
                trackers.finish({"final_loss": 2.5})
        if not start:
            ids = json.loads((tmp_path / "trackers.json").read_text())
    assert json.loads((tmp_path / "trackers.json").read_text()) == ids
    expected = {**first, **second}

    events = tensorboard_run(tmp_path)  # purge_step 3 hides the first start's steps 3 and 4
    assert [(e.step, e.value) for e in events.Scalars("loss")] == list(expected.items())
    assert [e.value for e in events.Scalars("skipped")] == [0.0] * 4 and "time" not in events.Tags()["scalars"]

    offline_runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert [wandb_history(wandb_records(r), "loss") for r in offline_runs] == [first, second]

    client = mlflow_client(tmp_path)  # the same run; MLflow cannot delete the first start's steps 3 and 4
    history = sorted(client.get_metric_history(ids["mlflow"], "loss"), key=lambda m: (m.timestamp, m.step))
    assert [(m.step, m.value) for m in history] == [*first.items(), *second.items()]
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["log.report_to"] == "tensorboard, wandb, mlflow"

    for error, status in ((RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")):  # a new run each (step 0)
        with pytest.raises(error), Trackers(["mlflow"], tmp_path) as trackers:
            trackers.start(config, resume_step=0)
            raise error
        new_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
        assert new_id != ids["mlflow"] and client.get_run(new_id).info.status == status


@pytest.mark.slow
def test_resume_continues_the_tracker_runs(tmp_path: Path) -> None:
    """A crash after step 4 with checkpoints at 2 and 4 lost the one at 4: the run replays 3 and 4."""
    run, data = tmp_path / "run", corpus_file(tmp_path)
    args = ["train", "--nproc", "1", "--data", data, "--out", str(run), *TINY, "--set", "checkpoint.save_every=2",
            "--set", ALL]
    assert (proc := ndtrain(*args)).returncode == 0, proc.stderr[-3000:]
    first_ids, first = json.loads((run / "trackers.json").read_text()), records(run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    assert (proc := ndtrain(*args)).returncode == 0, proc.stderr[-3000:]
    assert "resuming at step 2" in proc.stdout
    loss = series(run, "loss")
    assert list(loss) == [1, 2, 3, 4] and records(run)[:2] == first[:2]
    assert records(run)[2]["elapsed_s"] > first[1]["elapsed_s"]  # the clock continues

    events = tensorboard_run(run)  # purge_step: the first start's steps 3 and 4 are gone
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, float32(v)) for s, v in loss.items()]

    ids = json.loads((run / "trackers.json").read_text())
    assert ids == first_ids
    offline_runs = sorted((run / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(offline_runs) == 2 and wandb_history(wandb_records(offline_runs[1]), "loss") == {3: loss[3], 4: loss[4]}

    client = mlflow_client(run)  # the same run; MLflow cannot delete the first start's steps 3 and 4
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 3, 4, 4]
    assert {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)} == loss
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"


def test_report_to_is_checked_at_config_load(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = resolve_config(None, {"log.report_to": ["tensorboard", "mlflow"]})
    assert cfg.log.report_to == ["tensorboard", "mlflow"] and resolve_config(None).log.report_to == []
    assert 'report_to = [\n    "tensorboard",\n    "mlflow",\n]' in dump_toml(cfg)  # tomli-w: one item a line
    with pytest.raises(UserError, match=r"'neptune': choose from tensorboard, wandb, mlflow"):
        resolve_config(None, {"log.report_to": ["neptune"]})
    with pytest.raises(UserError, match=r"'log.report_to' must be list\[str\], got 'wandb'"):
        resolve_config(None, {"log.report_to": "wandb"})
    with pytest.raises(UserError, match="names a tracker twice"):
        resolve_config(None, {"log.report_to": ["wandb", "wandb"]})
    import ndtrain.run.trackers

    real = ndtrain.run.trackers.importlib.util.find_spec
    monkeypatch.setattr(ndtrain.run.trackers.importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(UserError, match=r"wandb is not installed: pip install 'ndtrain\[wandb\]'"):
        resolve_config(None, {"log.report_to": ["tensorboard", "wandb"]})


def test_unknown_tracker_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = ndtrain("train", "--check", "--out", str(tmp_path / "r"), "--set", 'log.report_to=["tensorbored"]')
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ndtrain: error: log.report_to names 'tensorbored': choose from tensorboard, wandb, mlflow"
    ]


def test_git_revision_of_this_checkout_and_of_a_plain_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head = subprocess.run(["git", "-C", str(SOURCE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("the ndtrain sources are not a git checkout here")
    revision = git_revision()
    assert revision is not None and revision["commit"] == head.stdout.strip() and isinstance(revision["dirty"], bool)
    copy = tmp_path / "ndtrain"
    copy.mkdir()
    shutil.copy(SOURCE_DIR / "__init__.py", copy / "__init__.py")
    assert git_revision(copy) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert git_revision() is None


def test_metrics_records_carry_time_elapsed_and_epoch(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 2, "loss": 1.0, "elapsed_s": 100.0}) + "\n"
                    + json.dumps({"step": 3, "loss": 0.9, "elapsed_s": 150.0}) + "\n")
    seen: list[dict[str, Any]] = []
    log = MetricsLog(path, keep_until_step=2, steps_per_epoch=4, sinks=[seen.append])
    log.write({"step": 3, "loss": 0.5})
    kept, new = log.read()
    assert kept == {"step": 2, "loss": 1.0, "elapsed_s": 100.0} and seen == [new]
    assert new["step"] == 3 and new["epoch"] == 0.75 and 100.0 <= new["elapsed_s"] < 150.0
    assert new["time"].endswith("+00:00") and new["time"][:4].isdigit() and len(new["time"]) == 29
