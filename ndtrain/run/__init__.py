"""What one training run is made of besides its engine: its config completed and checked against
the model, tokenizer and trackers it names (config_checks.py), the launcher's checks before anything
is written (layout_check.py: the layout dry-run on the meta-device model; data_identity.py: resuming
on the data the checkpoint was trained on; directory.py: a run directory is ours or untouched; shared_dir.py: every rank sees the run directory),
the
task it trains (tasks.py), how the
trainer drives each kind of engine (engine_kinds.py), its lock (lock.py), its description and
clock (info.py), metrics, progress line and experiment trackers (metrics.py, progress.py,
trackers.py), signals that ask it to stop (preemption.py), its pipeline timeline (timeline.py) and
`ndtrain inspect` (inspect.py). Sits under `trainer.py`; imports `engine`, `models`, `data`,
`checkpoint` and the layers below them."""
