"""Parameter-server training: parameters live on server ranks, workers push gradients and pull
parameters (sync, async or bounded staleness: parameter_server.py), behind the same engine
interface as `Engine` (engine.py). Imports `dist`, `parallel` and `engine`."""
