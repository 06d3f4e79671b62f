"""What test modules share (no test module imports another):

- `runner`: run a function on N gloo worker processes with a hard timeout; per-case results of a matrix.
- `parity`: compare trained tensors with a reference, failing on NaN/inf and naming the worst tensor.
- `reference`: the single-process reference trainer the parity tests compare against.
- `models`: the tiny models (ndtrain's Llama, Hugging Face families), their batches and optimizers.
- `runs`: corpora, tiny run configs, the CLI in a subprocess, launcher processes and their files.
"""
