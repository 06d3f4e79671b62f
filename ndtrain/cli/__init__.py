"""The `ndtrain` command: argument parsing (flags.py: one flag per config key) and the sub-commands
(commands.py: train, generate, export, inspect, report, bench, plan), what `train` does in the
launching process before workers start (prepare.py, layout_auto.py for --layout auto) or under
mpirun/srun (external.py). The top layer: it may import
any room of the package; nothing imports it."""

from ndtrain.cli.commands import main

__all__ = ["main"]
