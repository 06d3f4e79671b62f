"""`ndtrain report DIR [--out FILE.html]`: one self-contained HTML page about a run or a bench folder.

A run directory (it has `metrics.jsonl`, written by the trainer) gives: the summary
(`summary.json`), plots against step of train and validation loss, throughput, step time, peak
memory and communication bytes (and learning rate and gradient norm when recorded), the
pipeline timeline when the run recorded one (`timeline.json`, `log.timeline`), the layout and
the resolved config (`config.toml`), and the latest value of every metrics field. The loss is
plotted in the run's unit: summary.json's `loss_unit`, or while the run goes on (no summary yet)
the one its config.toml implies (run/tasks.py `loss_unit`: nats/byte for the byte tokenizer,
nats/token for any other). Records are read defensively: a plot is drawn for each field present,
whatever else a record holds.
A folder of `ndtrain bench` JSON results gives the bench page (`report_bench`).
Missing or corrupt metrics, and any other directory, end in one `UserError` line.
Default output: DIR/report.html.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from ndtrain.config.presets import DEFAULT_PRESET
from ndtrain.report import html as h
from ndtrain.errors import UserError
from ndtrain.report.bench import bench_files, bench_page
from ndtrain.report.plots import Series, curve, pipeline_timeline
from ndtrain.run.tasks import loss_unit
from ndtrain.run.timeline import FILE_NAME as TIMELINE_FILE, read_timeline

METRICS_FILE = "metrics.jsonl"
_MIB = 2**20

# Plot name → (title, y label, [(metrics field, series label)], scale applied to the values, log y axis);
# the loss's y label is the run's unit (`run_loss_unit`).
RUN_PLOTS: dict[str, tuple[str, str, list[tuple[str, str]], float, bool]] = {
    "loss": ("Loss", "loss", [("loss", "train"), ("val_loss", "validation")], 1.0, False),
    "val_accuracy": ("Validation next-token accuracy", "accuracy", [("val_accuracy", "validation")], 1.0, False),
    "throughput": ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")], 1.0, False),
    "step_time": ("Step time", "seconds", [("step_time_s", "step time")], 1.0, False),
    "memory": ("Peak memory (rank 0)", "MiB", [("peak_memory_bytes", "peak")], 1 / _MIB, False),
    "comm": ("Communication per step (rank 0, sent)", "MiB", [("comm_bytes_per_step", "bytes")], 1 / _MIB, False),
    "lr": ("Learning rate", "lr", [("lr", "lr")], 1.0, False),
    "grad_norm": ("Gradient norm", "norm (before clipping)", [("grad_norm", "norm")], 1.0, True),
}
REQUIRED_PLOTS = ("loss", "throughput", "step_time", "memory", "comm")  # the rest only when recorded


def write_report(directory: Path, out: Path | None = None) -> Path:
    """Write the page for a run directory or a bench-results folder; return where it went."""
    page = run_page(directory) if detect(directory) == "run" else bench_page(directory, bench_files(directory))
    target = out or directory / "report.html"
    try:
        target.write_text(page, encoding="utf-8")
    except OSError as e:
        raise UserError(f"report: cannot write {str(target)!r}: {e.strerror}: give a writable --out") from None
    return target


def detect(directory: Path) -> str:
    """'run' or 'bench'; a UserError naming what is expected for anything else."""
    expected = (f"give a run directory (with {METRICS_FILE}, written by `ndtrain train`) or a folder of "
                "`ndtrain bench` JSON results (e.g. bench-results/)")
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise UserError(f"report: {str(directory)!r} {what}: {expected}")
    if (directory / METRICS_FILE).exists():
        return "run"
    if any((directory / name).exists() for name in ("config.toml", "summary.json", "checkpoints")):
        raise UserError(f"report: run directory {str(directory)!r} has no {METRICS_FILE}: the run has not logged "
                        "a step yet; train it first (ndtrain train --out ...)")
    if bench_files(directory):
        return "bench"
    raise UserError(f"report: {str(directory)!r} holds neither {METRICS_FILE} nor `ndtrain bench` results: {expected}")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of metrics.jsonl (a JSON object with an integer 'step' per line); UserError if none or corrupt."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"report: cannot read {str(path)!r} ({e}): it must be the trainer's JSON-lines metrics") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError(f"report: {str(path)!r} line {number} is not a metrics record (a JSON object with a "
                            "'step'): the file is corrupt; restore it or re-run the training")
        records.append(record)
    if not records:
        raise UserError(f"report: {str(path)!r} holds no records: the run has not logged a step yet")
    return records


def run_page(run_dir: Path) -> str:
    records = read_metrics(run_dir / METRICS_FILE)
    summary = _read_json(run_dir / "summary.json")
    config_text, config = _read_config(run_dir / "config.toml")
    sections = [
        h.section("Summary", h.table([[k, h.fmt(k, v)] for k, v in summary.items()]) if isinstance(summary, dict)
                  else h.note(summary)),
        h.section("Training curves", *_curves(records, run_loss_unit(summary, config))),
    ]
    if (run_dir / TIMELINE_FILE).exists():
        sections.append(h.section("Pipeline timeline", _timeline(run_dir / TIMELINE_FILE)))
    layout = describe_layout(config, summary if isinstance(summary, dict) else {})
    sections.append(h.section("Layout and resolved config", f"<p>{h.esc(layout)}</p>",
                              h.pre(config_text) if config is not None else h.note("no readable config.toml")))
    sections.append(h.section("Latest value of every metrics field", _latest(records)))
    steps = [r["step"] for r in records]
    subtitle = f"{len(records)} metrics records, steps {min(steps)}–{max(steps)}; from {run_dir.resolve()}"
    return h.page(f"ndtrain run report: {run_dir.resolve().name}", subtitle, sections)


def run_loss_unit(summary: dict[str, Any] | str, config: dict[str, Any] | None) -> str:
    """The unit of the run's loss: summary.json's, else the one config.toml implies; 'unknown unit' without either."""
    if isinstance(summary, dict) and isinstance(summary.get("loss_unit"), str):
        return summary["loss_unit"]
    if config is None:
        return "unknown unit"
    model, data = (table if isinstance(table := config.get(name), dict) else {} for name in ("model", "data"))
    return loss_unit(str(model.get("preset", DEFAULT_PRESET)), str(data.get("tokenizer", "bytes")))


def _curves(records: list[dict[str, Any]], unit: str) -> list[str]:
    figures, missing = [], []
    for name, (title, ylabel, fields, scale, log_y) in RUN_PLOTS.items():
        ylabel = unit if name == "loss" else ylabel
        series = []
        for key, label in fields:
            points = [(r["step"], r[key] * scale) for r in records if _number(r.get(key))]
            if points:
                series.append(Series(label, *map(list, zip(*points)), markers=key == "val_loss" or len(points) < 3))
        if series:
            positive = all(v > 0 for s in series for v in s.values)
            caption = f"loss in {unit}" if name == "loss" else ""
            figures.append(h.image(name, curve(series, title, ylabel, log_y and positive), title, caption))
        elif name in REQUIRED_PLOTS:
            missing.append(f"{title} ({', '.join(k for k, _ in fields)})")
    parts = [h.plots(*figures)]
    if missing:
        parts.append(h.note("not recorded in metrics.jsonl: " + "; ".join(missing)))
    if not any(_number(r.get("val_loss")) for r in records):
        parts.append(h.note("no validation records yet (the run evaluates every log.eval_every steps and at the end)"))
    return parts


def _timeline(path: Path) -> str:
    try:
        header, ranks = read_timeline(path)
    except UserError as e:
        return h.note(str(e))
    title = (f"step {header.get('step')}, schedule {header.get('schedule')}"
             + (f" × {header['virtual']} virtual" if header.get("virtual", 1) > 1 else "") + f", pp={len(ranks)}")
    caption = (f"{title}: one row per pipeline rank; blue forward, green backward (olive/purple: input/weight "
               "gradients of zero-bubble), grey waiting for a receive; numbers are micro-batch[.chunk]")
    return h.plots(h.image("timeline", pipeline_timeline(ranks, title), f"pipeline timeline, {title}", caption))


def describe_layout(config: dict[str, Any] | None, summary: dict[str, Any]) -> str:
    """One line such as 'dp 2 × cp 1 × pp 1 × tp 1 on 2 processes; ZeRO 0; fp32'."""
    if config is None:
        return "layout unknown: config.toml is missing or unreadable"
    p = config.get("parallel", {})
    axes = {a: p.get(a, 1) for a in ("cp", "pp", "tp")}
    world = summary.get("world_size") or config.get("launch", {}).get("nproc")
    dp = p.get("dp") or (world // math.prod(axes.values()) if isinstance(world, int) else "?")
    line = f"dp {dp} × cp {axes['cp']} × pp {axes['pp']} × tp {axes['tp']}"
    line += f" on {world} process{'es' if world != 1 else ''}" if world else ""
    line += f"; ZeRO {p.get('zero', 0)}; precision {p.get('precision', 'fp32')}"
    if axes["pp"] > 1:
        line += f"; pipeline schedule {p.get('pp_schedule')}" + (f" × {p['pp_virtual']} virtual"
                                                               if p.get("pp_virtual", 1) > 1 else "")
    if p.get("sequence_parallel"):
        line += "; sequence parallel"
    if p.get("dp_mode") == "single-process":
        line += f"; single-process DataParallel over {p.get('replicas')} replicas"
    if config.get("ps", {}).get("servers"):
        line += f"; parameter server: {config['ps']['servers']} servers, {config['ps'].get('mode')}"
    return line


def _latest(records: list[dict[str, Any]]) -> str:
    latest: dict[str, tuple[int, Any]] = {}
    for r in records:
        for key, value in r.items():
            latest[key] = (r["step"], value)
    return h.table([[k, h.fmt(k, v), s] for k, (s, v) in latest.items()], ["field", "latest value", "at step"])


def _read_json(path: Path) -> dict[str, Any] | str:
    """The file's object, or a sentence saying why there is none (the run may still be going)."""
    if not path.exists():
        return f"no {path.name}: the run has not finished (or was stopped early)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{path.name} is unreadable: {e}"
    return data if isinstance(data, dict) else f"{path.name} is not a JSON object"


def _read_config(path: Path) -> tuple[str, dict[str, Any] | None]:
    try:
        text = path.read_text(encoding="utf-8")
        return text, tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "", None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
