"""Checkpoints and model files: DCP directories written as `.partial`, finished with a manifest
(manifest.py) and renamed; loading verifies and falls back (store.py); each rank's slices of every
parameter under its unsharded name, asked of the data-parallel strategy (slices.py, format.py);
the restricted unpickler (safe_pickle.py); a run's model out as safetensors or a Hugging Face folder
(export.py, export_hf.py) and weights in for fine-tuning (init_from.py).
Imports `dist`, `parallel` (the strategy interface and `Placement`) and, for export/import only,
`models`."""
