"""`ndtrain bench`: ours against PyTorch's equivalent, same model, data and seed, alternating runs
(one module per scenario, harness.py runs and times them, cli.py launches them), and the one-GPU
check (gpu_check.py). Near the top: imports the engine, the strategies, models, data and `launch`."""
