"""Models: the built-in Llama (llama.py) and how the strategies split it (llama_parallel.py); Hugging
Face causal LMs (hf.py builds them, causal_lm.py adapts them to ndtrain's model contract) with their
family specs (hf_families.py: where a family's parts are; hf_parallel.py: its `ModelParallel` answers;
hf_stages.py: pipeline stages; hf_context.py: ring attention through the family's attention); the
Llama ↔ Hugging Face name mapping (llama_hf.py); the digits model of the retrieval task (digits.py);
the model a run's config names (build.py).

A model brings its parallel plan through `parallel_spec()` (parallel/model_spec.py). Models import
`parallel` (the spec interface, tensor/vocab layers, ring attention, precision), `dist`, `config` and
`errors`; never `checkpoint`, the engine, `run`, `cli` or the trainer, and nothing under `parallel`
imports a model (tests/test_import_graph.py).
"""

from ndtrain.models.llama import Llama, build_model

__all__ = ["Llama", "build_model"]
