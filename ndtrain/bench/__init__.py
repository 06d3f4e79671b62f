"""`ndtrain bench`: ours against PyTorch's equivalent, same model, data and seed, alternating runs."""
