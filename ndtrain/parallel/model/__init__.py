"""Model parallelism inside a layer or a block: tensor parallel layers and the plan interpreter
(tensor.py, vocab.py, tp_plan.py), context parallel ring attention (context.py) and activation
recomputation (recompute.py). They learn a model's structure only through the spec interface a
model provides; they import `dist`, `config` and `parallel`'s shared modules, never a model."""
