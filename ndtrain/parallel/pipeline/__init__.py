"""Pipeline parallel: stages cut from one model (partition.py), micro-batches run by a schedule given
as data (schedules.py) through one runner (runner.py) that is handed each stage's synchronisation
hooks by the data-parallel strategy (hooks.py); tied weights across stages (tied_shards.py), split
backward passes (split_backward.py), the recorded timeline (timeline.py). Imports `dist`, `config`,
`errors` and `parallel`'s shared modules; never a data-parallel strategy's type, never a model."""

from ndtrain.parallel.pipeline.partition import is_pipeline_duplicate, split_model
from ndtrain.parallel.pipeline.runner import eval_pipeline, run_pipeline
from ndtrain.parallel.pipeline.schedules import SCHEDULES
from ndtrain.parallel.pipeline.timeline import Timeline, bubble_fraction, write_chrome_trace, write_png

__all__ = [
    "SCHEDULES", "Timeline", "bubble_fraction", "eval_pipeline", "is_pipeline_duplicate", "run_pipeline", "split_model",
    "write_chrome_trace", "write_png",
]
