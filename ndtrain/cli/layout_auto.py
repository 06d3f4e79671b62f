"""`ndtrain train --layout auto` in the launching process: plan once before any worker starts, hand the
workers the choice, record it in the run directory, and set it against the run at the end.

- `plan_run`: the planner's choice (plan/auto.py) for the device the run would use (parallel.device): the
  calibrated CPU profile `parallel.layout_profile` (`--profile`, default plan-profile.json) for `nproc`
  processes, or the CUDA GPU's datasheet; the layout keys the user gave (config file, flags, `--set`:
  `given_layout_keys`) stay fixed. Returns the config with the choice written in, and prints one line
  (on stderr under `--check`, whose stdout is the resolved TOML).
- `worker_argv`: the command line the workers re-run, the launcher's own with the choice appended as
  `--set` keys (last, so they win), `parallel.layout = "manual"` among them: no worker plans, and the
  run's config.toml holds the chosen layout, a run of its own with `--layout manual`.
- `write_prediction`, `report_measured`: RUN_DIR/layout-auto.json (the chosen planner layout, predicted
  step seconds and memory bytes, the profile), written after the run directory is claimed; after the run,
  the trainer's `step_time_median_s` (summary.json: every step of this invocation after its first
  `trainer.STEADY_AFTER`, whatever log.every), printed in one line and added to the file.
- `refuse_outside_launcher`: a process started by torchrun, mpirun or srun is one of many, none the
  launcher, so `--layout auto` there is refused in one line rather than planned per rank.

Cost: one `search` (pure arithmetic) before the run, one read of summary.json after it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ndtrain.config import TrainConfig, raw_config
from ndtrain.errors import UserError
from ndtrain.plan import auto
from ndtrain.trainer import STEADY_AFTER

RECORD = "layout-auto.json"


def given_layout_keys(config_path: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The layout keys (`auto.LAYOUT_KEYS`) set by the config file, the flags or `--set`, with their values."""
    raw = raw_config(config_path, overrides)
    given = {}
    for key in auto.LAYOUT_KEYS:
        section, name = key.split(".")
        table = raw.get(section)
        if isinstance(table, dict) and name in table:
            given[key] = table[name]
    return given


def plan_run(cfg: TrainConfig, given: dict[str, Any], check: bool) -> tuple[TrainConfig, auto.Choice]:
    """`cfg` with the planner's layout for `cfg.launch.nproc` processes of this machine, and the choice."""
    import torch

    from ndtrain.dist.mesh import resolve_device

    device = resolve_device(cfg.parallel.device, 0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = Path(cfg.parallel.layout_profile)
    hardware, machine = auto.machine(device.type, name, profile, cfg.launch.nproc, cfg.model.preset)
    choice = auto.choose(cfg, cfg.launch.nproc, auto.fixed_axes(given), hardware, machine,
                         profile if device.type == "cpu" else None)
    print(choice.line(), file=sys.stderr if check else sys.stdout, flush=True)
    return auto.apply(cfg, auto.layout_overrides(choice.layout)), choice


def worker_argv(argv: list[str], choice: auto.Choice) -> list[str]:
    """`argv` with the chosen layout appended as `--set key=value` (TOML values: they win over every earlier one)."""
    tail = []
    for key, value in auto.layout_overrides(choice.layout).items():
        text = json.dumps(value) if isinstance(value, (bool, str)) else str(value)
        tail += ["--set", f"{key}={text}"]
    return [*argv, *tail]


def write_prediction(run_dir: Path, choice: auto.Choice) -> None:
    (run_dir / RECORD).write_text(json.dumps(choice.record(), indent=1) + "\n")


def measured_step_s(run_dir: Path) -> float | None:
    """The median step of this invocation after its first STEADY_AFTER (None when it ran no more)."""
    median = json.loads((run_dir / "summary.json").read_text()).get("step_time_median_s")
    return float(median) if median is not None else None


def report_measured(run_dir: Path, choice: auto.Choice) -> None:
    """Print the predicted-vs-measured line and add the measured step to RUN_DIR/layout-auto.json."""
    try:
        measured = measured_step_s(run_dir)
    except (OSError, ValueError):
        measured = None
    record = choice.record()
    record.update(measured_step_s=measured, warmup_steps=STEADY_AFTER)
    predicted = f"predicted step {choice.step_s * 1e3:.1f} ms"
    if measured is None:
        print(f"ndtrain: layout auto: {predicted}, measured: no step after the first {STEADY_AFTER} "
              "(run more steps)", flush=True)
    else:
        error = (choice.step_s - measured) / measured
        record["error"] = error
        print(f"ndtrain: layout auto: {predicted}, measured {measured * 1e3:.1f} ms (median of steps after the first "
              f"{STEADY_AFTER}), error {error * 100:+.1f} %", flush=True)
    (run_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def refuse_outside_launcher(cfg: TrainConfig, launcher: str) -> TrainConfig:
    """`cfg`, unless it asks for --layout auto in a process `launcher` started (one of many, none the launcher)."""
    if cfg.parallel.layout == "auto":
        raise UserError(f"--layout auto is planned by ndtrain's own launcher, not in processes {launcher} started: "
                        "run `ndtrain train --layout auto --check` with the same flags to see the choice, then pass "
                        f"its layout flags ({auto.LAYOUT_FLAGS}, --micro-batch ...)")
    return cfg
