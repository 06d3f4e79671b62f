"""The process layer every other room stands on: the `ParallelContext` (mesh.py: the world, the group of
every axis and each rank's coordinates), the counted, sequenced and watched collectives (comm.py,
watchdog.py), the shared-memory rings of one CPU host (host_slots.py, host_stream.py) and peak-memory
accounting (memory.py); which launcher started this process and where its ranks meet (launchers.py:
torchrun, Open MPI, MPICH, Slurm). Imports only `config`, `errors` and torch: nothing here knows a model,
a strategy or a run."""
